"""Build libmoe_rt.so, the C core and ABI (include/moe_rt/moe_rt.h), with a C compiler alone: no CUDA
header, library or compiler (the driver is dlopen'ed at run time); and libmoe_rt_xla.so, the XLA FFI
handlers of moe_rt.jax (csrc/xla_ffi.c, linked to libmoe_rt.so), where jaxlib's FFI headers are present.
Used by setup.py, moe_rt.jax and the tests; ``python3 csrc/libbuild.py [OUT.so]`` builds the core by hand
(default: moe_rt/lib/libmoe_rt.so), ``python3 csrc/libbuild.py --xla [OUT.so]`` the XLA library next to it."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("context.c", "router.c", "permutation.c", "fp8.c", "ep_ll.c", "ep_direct.c", "ep_prepare.c", "comm.c",
           "peer.c")
# a function used without its declaration is an error: C would take it as returning int, and a pointer it
# returns (getenv's) would lose its upper half
CFLAGS = ("-std=c11", "-O2", "-fPIC", "-Wall", "-Wextra", "-Werror=implicit-function-declaration",
          "-Wno-unused-parameter", "-fvisibility=default")
LIBS = ("-ldl", "-lpthread")


def source_hash(root: Path = ROOT) -> str:
    """SHA-1 over the kernel sources and headers, as moe_rt._jit.source_hash computes it (the manifest of a
    kernel-cache folder records it; the library refuses a folder written from other sources)."""
    h = hashlib.sha1()
    for folder in (root / "kernels", root / "include"):
        for p in sorted(folder.rglob("*")):
            if p.suffix in (".cu", ".cuh", ".h"):
                h.update(p.name.encode())
                h.update(p.read_bytes())
    return h.hexdigest()


def compiler() -> str | None:
    """The C compiler: $CC, else cc or gcc on PATH (None when there is none)."""
    cc = os.environ.get("CC")
    if cc:
        return cc
    return shutil.which("cc") or shutil.which("gcc")


def command(out: str | os.PathLike, cc: str | None = None, root: Path = ROOT) -> list[str]:
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    srcs = [str(root / "csrc" / s) for s in SOURCES]
    return ([*cc.split(), *CFLAGS, f"-I{root / 'include'}", f"-I{root / 'csrc'}",
             f'-DMOE_RT_SOURCE_HASH="{source_hash(root)}"', "-shared", "-o", str(out)] + srcs + list(LIBS))


XLA_SOURCES = ("xla_ffi.c",)
XLA_LIB = "libmoe_rt_xla.so"


def xla_include_dir() -> str | None:
    """The folder holding xla/ffi/api/c_api.h: jaxlib's (jax.ffi.include_dir()), None without jax."""
    try:
        import jax.ffi
    except ImportError:
        return None
    inc = jax.ffi.include_dir()
    return inc if (Path(inc) / "xla" / "ffi" / "api" / "c_api.h").is_file() else None


def xla_command(out: str | os.PathLike, core: str | os.PathLike, include: str, cc: str | None = None,
                root: Path = ROOT) -> list[str]:
    """The compile-and-link command of libmoe_rt_xla.so, linked to the core library ``core`` (found at run
    time next to ``out``, or in ``core``'s folder when that is another one)."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    out, core = Path(out).resolve(), Path(core).resolve()
    rpath = "$ORIGIN" if core.parent == out.parent else str(core.parent)
    srcs = [str(root / "csrc" / s) for s in XLA_SOURCES]
    return ([*cc.split(), *CFLAGS, "-fvisibility=hidden", f"-I{root / 'include'}", f"-I{include}", "-shared",
             "-o", str(out)] + srcs + [f"-L{core.parent}", "-l:" + core.name, f"-Wl,-rpath,{rpath}", *LIBS])


def build_xla(out: str | os.PathLike, core: str | os.PathLike, include: str | None = None,
              cc: str | None = None) -> Path:
    """Compile and link libmoe_rt_xla.so to ``out`` against jaxlib's headers (``include``, default
    :func:`xla_include_dir`); raises RuntimeError without them, CalledProcessError with the compiler's
    output on failure."""
    include = include or xla_include_dir()
    if include is None:
        raise RuntimeError("jaxlib's XLA FFI headers (jax.ffi.include_dir()) are not available: install jax")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(xla_command(out, core, include, cc), check=True, capture_output=True, text=True)
    return out


def build(out: str | os.PathLike, cc: str | None = None) -> Path:
    """Compile and link the library to ``out``; raises CalledProcessError with the compiler's output."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(command(out, cc), check=True, capture_output=True, text=True)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    xla = "--xla" in args
    args = [a for a in args if a != "--xla"]
    default = ROOT / "moe_rt" / "lib" / (XLA_LIB if xla else "libmoe_rt.so")
    target = args[0] if args else str(default)
    try:
        print(build_xla(target, Path(target).parent / "libmoe_rt.so") if xla else build(target))
    except subprocess.CalledProcessError as e:
        sys.stderr.write(e.stdout + e.stderr)
        sys.exit(1)
