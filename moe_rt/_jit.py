"""Kernel registry and compile cache: (file, name expression) -> compiled CUDA function.

Each op module registers the template instantiations it launches (``register``). Every instantiation is its
own NVRTC program, compiled when it is first launched (a router call compiles the one variant it runs, in a
second or two, not the whole file) for the current device's architecture, and kept in an on-disk cache that
processes share: the first process to need a kernel compiles it under a file lock, the others wait for the
lock and load the result. The cache key covers the contents of every file under ``kernels/`` and
``include/``, the compile options, the NVRTC version, the architecture and the name expression, so editing
a header recompiles, and a cache folder copied to another machine is used there only where all of these
match.

Cache folder: ``MOE_RT_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/moe_rt/kernels`` (``~/.cache/moe_rt/kernels``);
with ``MOE_RT_NVRTC_OPTIONS`` set, its subfolder ``nvrtc-<hash of the options>`` (``cache_dir``).
Inside: ``<arch>/<file stem>.<name>.<key>.cubin`` (``.ptx`` for an architecture NVRTC has no machine code
for) with a ``.json`` beside it naming the kernel and its lowered (mangled) name; ``python -m moe_rt warmup``
also writes ``manifest.json``, the index a loader without Python reads. Nothing is written into the package
folder. A compile longer than a second says so on stderr (``MOE_RT_QUIET=1``, or a level above INFO on the
``moe_rt`` logger, silences it).

``compile_offline`` and ``kernel_image`` build the same programs for a named architecture with NVRTC alone,
no GPU or driver needed; the test suite and ``warmup`` use them.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.resources
import json
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np

# dtype name -> C++ type of the kernels' template parameter
CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
FLOAT_DTYPES = tuple(CTYPES)

REGISTRY: dict[str, list[str]] = {}
QUICK: set = set()  # (file, name) of quick kernels (stand-ins, see below): compile-checked, not warmed up
_lock = threading.Lock()
_functions: dict[tuple[str, str, int], object] = {}
_functions_root: str | None = None  # the kernel cache folder the kernels in _functions were loaded from
_CACHE_FORMAT = 2  # part of every key: bump when the cache entries' format changes
_SLOW_COMPILE_S = 1.0  # compiles (and waits for another process's compile) longer than this are reported


def ctype(dtype) -> str:
    """C++ type name for a float dtype (float32, float16, bfloat16)."""
    name = np.dtype(dtype).name
    try:
        return CTYPES[name]
    except KeyError:
        raise TypeError(f"no kernel instantiation for dtype {name}; expected one of {FLOAT_DTYPES}") from None


def register(file: str, names, *, quick: bool = False) -> None:
    """Declare the name expressions (``"kernel<__half, 4>"`` or ``"extern_c_kernel"``) of ``file`` that
    ops launch (at module import time): what ``warmup`` compiles. ``quick``: kernels that stand in for others
    while those compile (:func:`compile_in_background`); ``warmup`` leaves them out."""
    with _lock:
        lst = REGISTRY.setdefault(file, [])
        for n in names:
            if n not in lst:
                lst.append(n)
            if quick:
                QUICK.add((file, n))


def registered(*, quick: bool = True) -> list[tuple[str, str]]:
    """Every registered (file, name expression), in registration order (``quick=False``: without the quick
    kernels)."""
    return [(f, n) for f, names in REGISTRY.items() for n in names if quick or (f, n) not in QUICK]


def _dir(package: str, fallback: str, marker: str) -> Path:
    # A source checkout's own folder first (an editable install maps the package data of whichever checkout
    # was installed, which need not be the one imported), then the installed package data.
    here = Path(__file__).resolve().parent.parent / fallback
    if (here / marker).is_file():
        return here
    try:
        p = Path(str(importlib.resources.files(package)))
        if p.is_dir():
            return p
    except (ModuleNotFoundError, TypeError):
        pass
    return here


@functools.lru_cache(maxsize=None)
def kernels_dir() -> Path:
    return _dir("moe_rt.kernels", "kernels", "common.cu")


@functools.lru_cache(maxsize=None)
def include_dir() -> Path:
    """The folder holding ``moe_rt/*.cuh`` (passed to NVRTC as ``-I``)."""
    return _dir("moe_rt.include", "include", "moe_rt/common.cuh")


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """SHA-1 over the contents of every kernel and header file (part of the compile cache key)."""
    h = hashlib.sha1()
    for root in (kernels_dir(), include_dir()):
        for p in sorted(root.rglob("*")):
            if p.suffix in (".cu", ".cuh", ".h"):
                h.update(p.name.encode())
                h.update(p.read_bytes())
    return h.hexdigest()


def kernel_files() -> list[str]:
    return sorted(p.name for p in kernels_dir().glob("*.cu"))


def source(file: str) -> str:
    path = kernels_dir() / file
    if not path.is_file():
        raise FileNotFoundError(f"no kernel file {file} in {kernels_dir()}")
    return path.read_text()


def cache_dir() -> str:
    """The kernel cache folder: ``MOE_RT_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/moe_rt/kernels``; with
    ``MOE_RT_NVRTC_OPTIONS`` set, a subfolder ``nvrtc-<hash of those options>`` of it. The C core loads the
    kernels its folder's manifest lists by (file, name, architecture) alone, so builds of other options need
    a folder (and a manifest) of their own: otherwise a process with ``-DX=1`` would run the kernels another
    process listed without it."""
    env = os.environ.get("MOE_RT_KERNEL_CACHE")
    if env:
        root = os.path.abspath(os.path.expanduser(env))
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "moe_rt", "kernels")
    extra = extra_options()
    if extra:
        root = os.path.join(root, "nvrtc-" + hashlib.sha256("\0".join(extra).encode()).hexdigest()[:12])
    return root


def folder_changed(was: str, now: str) -> RuntimeError:
    """The error of a process whose kernel cache folder (:func:`cache_dir`) changed after its first op: the
    kernels it loaded from ``was`` would keep running while new ones came from ``now``."""
    return RuntimeError(
        f"the kernel cache folder is now {now}, but this process loaded its kernels from {was}: "
        "MOE_RT_KERNEL_CACHE or MOE_RT_NVRTC_OPTIONS (or XDG_CACHE_HOME) changed after its first op, and the "
        "kernels already loaded would keep running the old builds; set MOE_RT_NVRTC_OPTIONS / "
        "MOE_RT_KERNEL_CACHE before the first op of the process")


def extra_options() -> tuple[str, ...]:
    """The NVRTC options ``MOE_RT_NVRTC_OPTIONS`` adds (split at white space; empty when unset)."""
    return tuple(os.environ.get("MOE_RT_NVRTC_OPTIONS", "").split())


def options() -> tuple[str, ...]:
    """NVRTC options of every kernel program; ``MOE_RT_NVRTC_OPTIONS`` adds more (e.g. ``-lineinfo`` for a
    profiler's source view)."""
    return ("-std=c++17", f"-I{include_dir()}", f"-DMOE_RT_SOURCE_HASH=0x{source_hash()[:15]}") + extra_options()


# ---- messages ----------------------------------------------------------------------------------------

_log = logging.getLogger("moe_rt")


def say(msg: str) -> None:
    """One line on stderr about slow work (a compile), unless ``MOE_RT_QUIET=1``. A program that set a
    level on the ``moe_rt`` logger gets it as an INFO record instead (and silences it with a higher level)."""
    if os.environ.get("MOE_RT_QUIET", "0") not in ("", "0"):
        return
    if _log.level != logging.NOTSET or _log.handlers:
        _log.info(msg)
    else:
        print(msg, file=sys.stderr, flush=True)


# ---- NVRTC programs ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(int(v) for v in nvrtc.getVersion())


@functools.lru_cache(maxsize=None)
def _supported_archs() -> tuple[int, ...]:
    from cupy.cuda import nvrtc

    return tuple(int(a) for a in nvrtc.getSupportedArchs())


def arch_for(cc: tuple[int, int]) -> str:
    """The NVRTC target for a device of compute capability ``cc``: ``sm_XY`` (machine code) when NVRTC
    knows the architecture, else PTX for the newest one it knows below it (``compute_XY``), which the
    driver compiles when loading."""
    want = int(cc[0]) * 10 + int(cc[1])
    archs = _supported_archs()
    if want in archs:
        return f"sm_{want}"
    older = [a for a in archs if a < want]
    if not older:
        raise RuntimeError(f"NVRTC {'.'.join(map(str, nvrtc_version()))} cannot compile for sm_{want} "
                           f"(it knows {', '.join(f'sm_{a}' for a in archs)})")
    return f"compute_{max(older)}"


def check_arch(arch: str) -> str:
    """``arch`` if it is ``sm_XY`` or ``compute_XY`` with an architecture NVRTC knows; ValueError else."""
    m = re.fullmatch(r"(sm|compute)_(\d+)a?", arch or "")
    if not m:
        raise ValueError(f"arch: expected a name like sm_90 or compute_90, got {arch!r}")
    if int(m.group(2)) not in _supported_archs():
        raise ValueError(f"arch: NVRTC {'.'.join(map(str, nvrtc_version()))} does not know {arch} "
                         f"(it knows {', '.join(f'sm_{a}' for a in _supported_archs())})")
    return arch


def cuda_include_dir() -> str:
    """CUDA headers (cuda_bf16.h, ...) for NVRTC, as CuPy finds them."""
    from cuda import pathfinder

    d = pathfinder.find_nvidia_header_directory("cudart")
    if d is None:
        raise RuntimeError("CUDA headers not found; install the cu12 or cu13 extra of moe_rt")
    return str(d)


def _program_options(arch: str) -> list[str]:
    return list(options()) + [f"-I{cuda_include_dir()}", f"-arch={arch}", "-ftz=true",
                              "--device-as-default-execution-space"]


def _one_kernel_options(name: str) -> list[str]:
    """The defines of a program built for kernel ``name`` alone (include/moe_rt/common.cuh, MOE_RT_WANTS):
    kernels that are not templates, which NVRTC emits wherever they are defined, are left out but for
    ``name`` itself."""
    opts = ["-DMOE_RT_ONE_KERNEL=1"]
    if re.fullmatch(r"[A-Za-z_]\w*", name):
        opts.append(f"-DMOE_RT_KERNEL_{name}=1")
    return opts


def compile_offline(file: str, arch: str, names=None) -> tuple[bytes, dict[str, str]]:
    """Compile ``names`` (default: every registered name) of ``file`` as one NVRTC program for ``arch``
    (``sm_90``: a cubin; ``compute_90``: PTX), without a GPU; a program for a single name holds that kernel
    alone. Returns the image and the lowered name of each name expression; raises RuntimeError with NVRTC's
    log on failure."""
    from cupy.cuda import nvrtc

    names = list(REGISTRY.get(file, ())) if names is None else list(names)
    opts = _program_options(arch) + (_one_kernel_options(names[0]) if len(names) == 1 else [])
    prog = nvrtc.createProgram(source(file), file, [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed on {file} for {arch}:\n{nvrtc.getProgramLog(prog)}") from e
        image = nvrtc.getCUBIN(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog)
        lowered = {n: nvrtc.getLoweredName(prog, n) for n in names}
    finally:
        nvrtc.destroyProgram(prog)
    return image, lowered


def cache_key(file: str, name: str, arch: str) -> str:
    """The cache key of one kernel program (hex): sources and headers, options (without folder paths),
    NVRTC version, architecture and name expression."""
    opts = [o for o in options() if not o.startswith("-I")]
    blob = json.dumps([_CACHE_FORMAT, source_hash(), file, name, arch, opts, nvrtc_version()])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _entry(root: str, file: str, name: str, arch: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")[:80]
    ext = "cubin" if arch.startswith("sm_") else "ptx"
    return Path(root) / arch / f"{Path(file).stem}.{safe}.{cache_key(file, name, arch)}.{ext}"


def _read_entry(path: Path):
    meta = path.with_suffix(".json")
    try:
        info = json.loads(meta.read_text())
        image = path.read_bytes()
    except (OSError, ValueError):
        return None
    if not image or "lowered" not in info:
        return None
    return image, info["lowered"]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


_unwritable: set = set()


def kernel_image(file: str, name: str, arch: str, *, root: str | None = None,
                 where: str = "") -> tuple[bytes, str, bool]:
    """The compiled program of one kernel for ``arch``: ``(image, lowered name, compiled here)``.

    Served from the cache folder (``root``, default :func:`cache_dir`) when there; otherwise compiled under a
    file lock, so that concurrent processes compile it once and the others load what the first wrote. A
    cache folder that cannot be written is said once; its kernels are then compiled in each process."""
    root = cache_dir() if root is None else os.path.abspath(root)
    path = _entry(root, file, name, arch)
    got = _read_entry(path)
    if got is not None:
        return got[0], got[1], False
    lock = None
    if root not in _unwritable:
        try:
            import fcntl

            path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(path.with_suffix(".lock"), "a+b")
        except OSError as e:
            _unwritable.add(root)
            say(f"moe_rt: kernel cache {root} cannot be written ({e.strerror or e}); compiled kernels are "
                "kept in this process only")
    try:
        if lock is not None:
            t0 = time.perf_counter()
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            got = _read_entry(path)
            if got is not None:
                waited = time.perf_counter() - t0
                if waited > _SLOW_COMPILE_S:
                    say(f"moe_rt: waited {waited:.1f} s for another process to compile {name} ({file}) for {arch}")
                return got[0], got[1], False
        t0 = time.perf_counter()
        image, lowered = compile_offline(file, arch, [name])
        seconds = time.perf_counter() - t0
        if seconds > _SLOW_COMPILE_S:
            say(f"moe_rt: compiled {name} ({file}) for {arch} in {seconds:.1f} s{where}")
        if lock is not None:
            info = {"file": file, "name": name, "lowered": lowered[name], "arch": arch,
                    "nvrtc": ".".join(map(str, nvrtc_version())), "seconds": round(seconds, 3),
                    "source_hash": source_hash()}
            try:
                _write_atomic(path.with_suffix(".json"), json.dumps(info).encode())
                _write_atomic(path, image)  # the image last: its presence marks a complete entry
            except OSError as e:
                _unwritable.add(root)
                say(f"moe_rt: kernel cache {root} cannot be written ({e.strerror or e}); compiled kernels "
                    "are kept in this process only")
        return image, lowered[name], True
    finally:
        if lock is not None:
            lock.close()  # releases the lock


def cached_count(arch: str, root: str | None = None) -> int:
    """How many registered kernels of these sources have an entry for ``arch`` in the cache folder."""
    root = cache_dir() if root is None else root
    return sum(1 for f, n in registered(quick=False) if _entry(root, f, n, arch).is_file())


def cache_size(root: str | None = None) -> int:
    """Bytes under the cache folder."""
    root = Path(cache_dir() if root is None else root)
    if not root.is_dir():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def write_manifest(root: str, archs) -> Path:
    """``root/manifest.json``: every registered kernel's entry for each of ``archs`` (file, name expression,
    lowered name, image path relative to ``root``), for loaders that do not compute keys."""
    rows = [_manifest_row(root, f, n, arch) for arch in archs for f, n in registered(quick=False)]
    out = Path(root) / "manifest.json"
    _write_manifest(out, rows)
    return out


def _manifest_row(root: str, file: str, name: str, arch: str) -> dict:
    path = _entry(root, file, name, arch)
    got = _read_entry(path)
    if got is None:
        raise RuntimeError(f"kernel {name} ({file}) for {arch} is missing from {root}")
    return {"file": file, "name": name, "lowered": got[1], "arch": arch, "image": str(path.relative_to(root))}


def _write_manifest(out: Path, rows: list) -> None:
    _write_atomic(out, json.dumps({"format": _CACHE_FORMAT, "source_hash": source_hash(),
                                   "nvrtc": ".".join(map(str, nvrtc_version())),
                                   "options": list(extra_options()), "kernels": rows}, indent=1).encode())


def add_to_manifest(root: str, kernels) -> Path:
    """Add ``kernels`` ((file, name expression, arch) each, already compiled into ``root``) to
    ``root/manifest.json``, under a file lock so that processes merge their additions; a manifest written
    from other kernel sources, with other ``MOE_RT_NVRTC_OPTIONS`` (its ``options``) or by another NVRTC is
    replaced (the C core loads its rows by (file, name, arch) alone). The C
    core reads the manifest again when it misses a kernel."""
    import fcntl

    root_p = Path(root)
    root_p.mkdir(parents=True, exist_ok=True)
    out = root_p / "manifest.json"
    with open(root_p / "manifest.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        rows = []
        try:
            old = json.loads(out.read_text())
            if (old.get("source_hash") == source_hash() and old.get("format") == _CACHE_FORMAT
                    and old.get("options", []) == list(extra_options())
                    and old.get("nvrtc") == ".".join(map(str, nvrtc_version()))):
                rows = list(old.get("kernels", []))
        except (OSError, ValueError):
            pass
        have = {(r.get("file"), r.get("name"), r.get("arch")) for r in rows}
        added = False
        for file, name, arch in kernels:
            if (file, name, arch) in have:
                continue
            rows.append(_manifest_row(root, file, name, arch))
            have.add((file, name, arch))
            added = True
        if added or not out.is_file():
            _write_manifest(out, rows)
    return out



def cache_kernels(root: str, names, arch: str, where: str = "") -> None:
    """Compile the kernels ``names`` ((file, name expression) each) for ``arch`` into the cache folder
    ``root`` (those already there are read, not compiled) and list them in its manifest: what a C core context
    on that folder needs to load them (moe_rt._core for the Python ops, moe_rt._xla for moe_rt.jax)."""
    for file, name in names:
        kernel_image(file, name, arch, root=root, where=where)
    add_to_manifest(root, [(f, n, arch) for f, n in names])


# ---- stand-ins: a first call that does not wait for a slow compile -----------------------------------
# On a kernel-cache miss (moe_rt._core), a launch for which the C core's planner names a stand-in (the router
# forward's: the same template compiled for the call's score case alone, which computes the same bits and
# compiles in a fraction of the time) gets the stand-in compiled and loaded into the core context in its place,
# and its own kernel compiles here on a background thread (NVRTC releases the GIL). When that is done, the
# core context swaps it in at its next call outside a CUDA graph capture (moe_rt_context_end_stand_ins): calls
# from then on are planned with it. A background compile that fails is logged; the next call that needs the
# kernel compiles it in the foreground, and raises there. MOE_RT_TIERED=0 compiles every kernel in the
# foreground instead. ``warmup`` compiles the kernels alone, never the stand-ins.

def env_choice(name: str, choices: tuple, default: str | None) -> str | None:
    """The value of the environment variable ``name``: one of ``choices``, ``default`` when unset or empty;
    anything else is a ValueError naming the variable (a misspelt switch must not run the default silently)."""
    v = os.environ.get(name) or default
    if v is not None and v not in choices:
        raise ValueError(f"{name}: expected {', '.join(choices[:-1])} or {choices[-1]}, got {v!r}")
    return v


def env_ints(name: str, default, low: int = 0, *, one: bool = False):
    """The environment variable ``name`` as a tuple of integers >= ``low`` (comma-separated; with ``one`` a
    single integer, returned as such), ``default`` when unset or empty; anything else is a ValueError naming
    the variable."""
    v = os.environ.get(name)
    if not v:
        return default
    try:
        out = tuple(int(p) for p in v.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < low or (one and len(out) != 1):
        what = "an integer" if one else "integers (comma-separated)"
        raise ValueError(f"{name}: expected {what} >= {low}, got {v!r}")
    return out[0] if one else out


TIERED = env_choice("MOE_RT_TIERED", ("0", "1"), "1") == "1"
_background: dict = {}  # (root, file, name, arch) -> its compiling thread
_failed: set = set()  # (root, file, name, arch) whose background compile failed: compiled in the foreground next
stand_ins_loaded = 0  # stand-ins loaded so far (moe_rt._core counts them; tools/bench_compile.py reports them)


def wants_stand_in(root: str, file: str, name: str, arch: str) -> bool:
    """Whether a launch of kernel ``name`` with a stand-in should run the stand-in while ``name`` compiles in
    the background: stand-ins are on, ``name`` is not in the cache folder ``root``, and no background compile
    of it failed."""
    return TIERED and (root, file, name, arch) not in _failed and not _entry(root, file, name, arch).is_file()


def compile_in_background(root: str, file: str, name: str, arch: str, done) -> bool:
    """Compile kernel ``name`` of ``file`` for ``arch`` into the cache folder ``root`` and its manifest on a
    background thread, then call ``done(ok)`` on that thread. False (and nothing started) when one is already
    compiling it."""
    global _join_at_exit
    key = (root, file, name, arch)
    with _lock:
        if key in _background:
            return False
        if not _join_at_exit:
            # A process must not end while NVRTC runs on a daemon thread: the C runtime's teardown then frees
            # memory the compile still uses (observed: a segfault, or glibc's "corrupted double-linked list",
            # after the script's last line). Exit waits for the compiles, which also completes their cache
            # entries. atexit runs before the interpreter's teardown.
            atexit.register(_join_background_at_exit)
            _join_at_exit = True
        th = _background[key] = threading.Thread(target=_compile_in_background, args=(key, done), daemon=True,
                                                 name=f"moe_rt compile {name}")
    th.start()
    return True


_join_at_exit = False


def _join_background_at_exit() -> None:
    running = [th.name for th in list(_background.values()) if th.is_alive()]
    if running:
        _log.info("moe_rt: waiting for %d background kernel compile(s) before exit", len(running))
    settle()


def _compile_in_background(key, done) -> None:
    root, file, name, arch = key
    try:
        cache_kernels(root, [(file, name)], arch, where=" (in the background)")
        ok = True
    except Exception as e:  # noqa: BLE001 - said here; the next call that needs it compiles it again and raises
        _failed.add(key)
        _log.warning("moe_rt: compiling %s (%s) for %s in the background failed (%s); the next call that needs "
                     "it compiles it in the foreground and raises", name, file, arch, str(e).splitlines()[0])
        ok = False
    try:
        done(ok)
    finally:
        with _lock:
            _background.pop(key, None)


def settle(timeout: float | None = None) -> bool:
    """Wait for the background compiles (:func:`compile_in_background`); True when none is left running. The
    next call of each op then runs its own kernel. Benchmarks call it before timing, so that they time the
    kernels later calls run."""
    end = None if timeout is None else time.perf_counter() + timeout
    for th in list(_background.values()):
        th.join(None if end is None else max(0.0, end - time.perf_counter()))
    return not any(th.is_alive() for th in list(_background.values()))

# ---- loaded kernels ----------------------------------------------------------------------------------

_CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
_CU_FUNC_ATTRIBUTE_NUM_REGS = 4
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class Kernel:
    """A loaded kernel: ``kernel`` is CuPy's ``Function`` (its ``ptr`` the CUfunction); calling it launches
    through CuPy as ``Function`` does."""

    __slots__ = ("kernel", "name", "_module")

    def __init__(self, module, lowered: str, name: str):
        self._module = module
        self.kernel = module.get_function(lowered)
        self.name = name

    @property
    def ptr(self) -> int:
        return int(self.kernel.ptr)

    @property
    def max_threads_per_block(self) -> int:
        """The most threads a block of this kernel may have (its launch bounds and registers)."""
        from cupy.cuda import driver

        return int(driver.funcGetAttribute(_CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, self.kernel.ptr))

    @property
    def num_regs(self) -> int:
        from cupy.cuda import driver

        return int(driver.funcGetAttribute(_CU_FUNC_ATTRIBUTE_NUM_REGS, self.kernel.ptr))

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        from cupy.cuda import driver

        return int(driver.funcGetAttribute(_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.kernel.ptr))

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, nbytes: int) -> None:
        from cupy.cuda import driver

        driver.funcSetAttribute(self.kernel.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes))

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        self.kernel(grid, block, args, shared_mem=shared_mem, stream=stream)

    def __repr__(self):
        return f"Kernel({self.name!r})"


def function(file: str, name: str) -> Kernel:
    """The compiled kernel ``name`` of ``file`` for the current CUDA device: loaded from the cache, or
    compiled (that one instantiation alone) on its first use. A kernel not loaded yet raises RuntimeError
    where the kernel cache folder (:func:`cache_dir`) is no longer the one the loaded kernels came from."""
    global _functions_root
    import cupy

    dev = cupy.cuda.Device().id
    key = (file, name, dev)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is not None:
            return fn
        if name not in REGISTRY.get(file, ()):
            raise KeyError(f"kernel {name!r} of {file} is not registered")
        root = cache_dir()
        if _functions and root != _functions_root:
            raise folder_changed(_functions_root, root)
        arch = arch_for(device_properties(dev)["cc"])
        image, lowered = kernel_image(file, name, arch, root=root)[:2]
        mod = cupy.cuda.function.Module()
        mod.load(image)
        fn = _functions[key] = Kernel(mod, lowered, name)
        _functions_root = root
        return fn


def global_ptr(file: str, kernel: str, symbol: str, device_id: int) -> int:
    """The device address of the ``extern "C" __device__`` variable ``symbol`` in the program of the
    registered kernel ``kernel`` of ``file`` on ``device_id``. Each kernel is its own program, with its own
    copy of the globals its source defines, so the kernel names the copy meant. The program is loaded on
    first use and never unloaded: the address holds for the life of the process."""
    import cupy

    with cupy.cuda.Device(device_id):
        k = function(file, kernel)
    g = k._module.get_global_var(symbol)  # the address (a MemoryPointer in some CuPy versions)
    return int(getattr(g, "ptr", g))


from moe_rt._arrays import DevArray  # noqa: E402

try:
    from moe_rt import _launch as _driver
except ImportError:  # pragma: no cover - the extension is built with the package
    _driver = None

# MOE_RT_LAUNCH=cupy launches every kernel through CuPy's launcher instead of the driver's (a test and
# benchmark switch; both launch the same function with the same arguments).
_use_driver = _driver is not None and env_choice("MOE_RT_LAUNCH", ("driver", "cupy"), "driver") == "driver"
_ptrs: dict = {}


def function_ptr(fn) -> int:
    """The CUfunction of a compiled kernel (a :class:`Kernel` or CuPy ``Function``)."""
    p = _ptrs.get(id(fn))
    if p is None:
        p = _ptrs[id(fn)] = (fn, int(getattr(fn, "kernel", fn).ptr))
    return p[1]


def launch_raw(fn, grid, block, args: tuple, shared_mem: int, stream) -> None:
    """Launch ``fn`` (a :class:`Kernel` or CuPy ``Function``) on the CuPy ``stream`` (None = CuPy's current stream), with no
    argument normalization: ``grid`` and ``block`` are ints or tuples of ints, nonzero."""
    if _use_driver:
        sptr = stream.ptr if stream is not None else _current_stream_ptr()
        if _driver.launch(function_ptr(fn), grid, block, args, sptr, shared_mem):
            return
    args = tuple(a.ptr if type(a) is DevArray else a for a in args)  # CuPy's launcher takes the pointer
    fn(grid if type(grid) is tuple else (grid,), block if type(block) is tuple else (block,), args,
       shared_mem=shared_mem, stream=stream)


def _current_stream_ptr() -> int:
    import cupy

    return cupy.cuda.get_current_stream().ptr


def launch(fn, grid, block, args, *, shared_mem: int = 0, stream=None) -> None:
    """Launch ``fn`` on ``stream`` (a cupy Stream; None = CuPy's current stream). ``args`` are CuPy arrays,
    NumPy scalars (``np.int32``, ``np.float32``, ...) or Python ints, which are passed as 64-bit values
    (pointers and ``long long`` parameters only)."""
    grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
    block = tuple(int(b) for b in (block if isinstance(block, tuple) else (block,)))
    if any(g == 0 for g in grid):
        return
    launch_raw(fn, grid, block, tuple(args), int(shared_mem), stream)


def set_max_dynamic_shared(fn, nbytes: int) -> None:
    """Opt ``fn`` in to ``nbytes`` of dynamic shared memory (needed above 48 KiB)."""
    if nbytes > 48 * 1024 and getattr(fn, "max_dynamic_shared_size_bytes", 0) < nbytes:
        fn.max_dynamic_shared_size_bytes = int(nbytes)


@functools.lru_cache(maxsize=None)
def device_properties(device_id: int) -> dict:
    """Multiprocessor count, shared memory limits, L2 size and compute capability of a device."""
    import cupy

    p = cupy.cuda.runtime.getDeviceProperties(device_id)
    return {
        "name": p["name"].decode() if isinstance(p["name"], bytes) else p["name"],
        "sm_count": int(p["multiProcessorCount"]),
        "smem_per_block_optin": int(p.get("sharedMemPerBlockOptin", 48 * 1024)),
        "smem_per_sm": int(p.get("sharedMemPerMultiprocessor", 0)),
        "l2_bytes": int(p.get("l2CacheSize", 0)),
        "cc": (int(p["major"]), int(p["minor"])),
        "total_memory": int(p["totalGlobalMem"]),
    }


def no_gpu_reason() -> str | None:
    """None when a CUDA GPU can be used, else one line saying why not (no CuPy, no driver, no device)."""
    try:
        import cupy
    except ImportError:
        return "no CUDA GPU: CuPy is not installed (pip install \"moe_rt[cu12]\" or \"moe_rt[cu13]\")"
    rt = cupy.cuda.runtime
    try:
        n = rt.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - a CUDARuntimeError from the driver check
        try:
            driver = rt.driverGetVersion()
        except Exception:  # noqa: BLE001
            driver = 0
        if not driver:
            return "no CUDA GPU: no CUDA driver is installed on this machine"
        return f"no usable CUDA GPU: {str(e).splitlines()[0]} (driver {driver // 1000}.{driver % 1000 // 10})"
    return None if n > 0 else "no CUDA GPU: the CUDA driver reports no device"


def require_gpu(what: str) -> None:
    """Raise RuntimeError ``"<what> needs a CUDA GPU; no CUDA GPU: ..."`` unless a CUDA GPU can be used."""
    why = no_gpu_reason()
    if why is not None:
        raise RuntimeError(f"{what} needs a CUDA GPU; {why}")


_L2_FETCH_LIMIT = 5  # cudaLimitMaxL2FetchGranularity
_L2_FETCH_SIZES = (32, 64, 128)


def l2_fetch_granularity(nbytes=None, *, device=None) -> int:
    """Read, or set, how many bytes the L2 cache fetches from device memory on a miss (CUDA's
    ``cudaLimitMaxL2FetchGranularity``, a hint the driver may round). Returns the value before the call.

    moe_rt never changes it by itself: the limit holds for the whole CUDA context of ``device`` (every
    library and kernel of the process on that GPU), and setting it waits for the device to go idle (about
    0.2 ms on an H100), so it is meant to be set once at start-up. Sparse reads gain from 32: the top-k
    backward reads K scattered entries of each row of grad and intermediate, and on an H100, whose default is
    64, it ran 1-8% faster at 32 (the most at E = 256; ``tools/bench_router.py --l2-fetch 32``), while
    kernels that read whole rows ran as before; at 128 it was 8-27% slower.

    Args:
        nbytes: None (only read), or 32, 64 or 128.
        device: CUDA device id; None = CuPy's current device.
    """
    if nbytes is not None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
            raise TypeError(f"nbytes: expected an int (32, 64 or 128) or None, got {type(nbytes).__name__}")
        if int(nbytes) not in _L2_FETCH_SIZES:
            raise ValueError(f"nbytes: expected 32, 64 or 128, got {int(nbytes)}")
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise TypeError(f"device: expected a CUDA device id (int) or None, got {type(device).__name__}")
        if int(device) < 0:
            raise ValueError(f"device: expected a CUDA device id >= 0, got {int(device)}")
    require_gpu("moe_rt.l2_fetch_granularity")
    import cupy

    if device is not None:
        count = cupy.cuda.runtime.getDeviceCount()
        if int(device) >= count:
            raise ValueError(f"device: {int(device)} is not a CUDA device of this machine ({count} found)")
    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    with dev:
        before = int(cupy.cuda.runtime.deviceGetLimit(_L2_FETCH_LIMIT))
        if nbytes is not None:
            cupy.cuda.runtime.deviceSetLimit(_L2_FETCH_LIMIT, int(nbytes))
    return before
