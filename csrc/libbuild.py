"""Build libmoe_rt.so, the C core and ABI (include/moe_rt/moe_rt.h), with a C compiler alone: no CUDA
header, library or compiler (the driver is dlopen'ed at run time). Used by setup.py and the tests;
``python3 csrc/libbuild.py [OUT.so]`` builds it by hand (default: moe_rt/lib/libmoe_rt.so)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("context.c", "router.c", "permutation.c")
CFLAGS = ("-std=c11", "-O2", "-fPIC", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=default")
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


def build(out: str | os.PathLike, cc: str | None = None) -> Path:
    """Compile and link the library to ``out``; raises CalledProcessError with the compiler's output."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(command(out, cc), check=True, capture_output=True, text=True)
    return out


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "moe_rt" / "lib" / "libmoe_rt.so")
    try:
        print(build(target))
    except subprocess.CalledProcessError as e:
        sys.stderr.write(e.stdout + e.stderr)
        sys.exit(1)
