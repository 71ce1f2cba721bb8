"""Kernel registry: (file, kernel name expression) -> compiled CUDA function, built once per process.

Each op module registers the template instantiations it launches (``register``); the first launch of any
kernel of a file compiles that whole file with NVRTC through CuPy ``RawModule``, for the current device's
architecture, with every registered name expression. CuPy's on-disk cache does not hash included headers,
so the options carry a hash of every file under ``kernels/`` and ``include/``: editing a header recompiles.
Nothing is written into the package folder (CuPy's cache lives in ``CUPY_CACHE_DIR``, by default
``~/.cupy/kernel_cache``).

``compile_offline`` builds the same sources for a named architecture with NVRTC alone, no GPU or driver
needed; the test suite uses it to check every kernel file and instantiation in CI.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.resources
import os
import threading
from pathlib import Path

import numpy as np

# dtype name -> C++ type of the kernels' template parameter
CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
FLOAT_DTYPES = tuple(CTYPES)

REGISTRY: dict[str, list[str]] = {}
_lock = threading.Lock()
_modules: dict[tuple[str, int], object] = {}
_functions: dict[tuple[str, str, int], object] = {}


def ctype(dtype) -> str:
    """C++ type name for a float dtype (float32, float16, bfloat16)."""
    name = np.dtype(dtype).name
    try:
        return CTYPES[name]
    except KeyError:
        raise TypeError(f"no kernel instantiation for dtype {name}; expected one of {FLOAT_DTYPES}") from None


def register(file: str, names) -> None:
    """Declare the name expressions (``"kernel<__half, 4>"`` or ``"extern_c_kernel"``) of ``file`` that
    ops launch. Must happen before the file's first compile in a process (module import time)."""
    with _lock:
        lst = REGISTRY.setdefault(file, [])
        for n in names:
            if n not in lst:
                lst.append(n)


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
    """Where compiled kernels are cached on disk (CuPy's kernel cache; never the package folder)."""
    if os.environ.get("CUPY_CACHE_IN_MEMORY", "0") not in ("", "0"):
        return "in memory (CUPY_CACHE_IN_MEMORY)"
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


def options() -> tuple[str, ...]:
    """NVRTC options of every kernel file; ``MOE_RT_NVRTC_OPTIONS`` adds more (e.g. ``-lineinfo`` for a
    profiler's source view)."""
    extra = tuple(os.environ.get("MOE_RT_NVRTC_OPTIONS", "").split())
    return ("-std=c++17", f"-I{include_dir()}", f"-DMOE_RT_SOURCE_HASH=0x{source_hash()[:15]}") + extra


def function(file: str, name: str):
    """The compiled function ``name`` of ``file`` for the current CUDA device."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (file, name, dev)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        if name not in REGISTRY.get(file, ()):
            raise KeyError(f"kernel {name!r} of {file} is not registered")
        mod = _modules.get((file, dev))
        if mod is None:
            names = list(REGISTRY[file])
            mod = cupy.RawModule(code=source(file), options=options(), name_expressions=names)
            if os.environ.get("MOE_RT_JIT_VERBOSE"):
                print(f"[moe_rt] compiling {file} for device {dev} ({len(names)} kernels)")
            _modules[(file, dev)] = mod
        fn = mod.get_function(name)
        _functions[key] = fn
        return fn


from moe_rt import _arrays  # noqa: E402
from moe_rt._arrays import DevArray  # noqa: E402

try:
    from moe_rt import _launch as _driver
except ImportError:  # pragma: no cover - the extension is built with the package
    _driver = None
_real_driver = _driver  # tests put a stand-in at _driver; recorded launches pack for the real one only

# MOE_RT_LAUNCH=cupy launches every kernel through CuPy's launcher instead of the driver's (a test and
# benchmark switch; both launch the same function with the same arguments).
_use_driver = _driver is not None and os.environ.get("MOE_RT_LAUNCH", "driver") != "cupy"
_ptrs: dict = {}


def function_ptr(fn) -> int:
    """The CUfunction of a compiled kernel (a CuPy ``RawKernel`` or ``Function``)."""
    p = _ptrs.get(id(fn))
    if p is None:
        p = _ptrs[id(fn)] = (fn, int(getattr(fn, "kernel", fn).ptr))
    return p[1]


def launch_raw(fn, grid, block, args: tuple, shared_mem: int, stream) -> None:
    """Launch ``fn`` (RawKernel or Function) on the CuPy ``stream`` (None = CuPy's current stream), with no
    argument normalization: ``grid`` and ``block`` are ints or tuples of ints, nonzero. While the calling
    thread records an op (:mod:`moe_rt._fast`), the launch is recorded instead of made."""
    if _arrays.RECORDING:
        rec = _arrays.recorder()
        if rec is not None:
            rec.launch(fn, grid, block, args, shared_mem)
            return
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


# ---- compile without a GPU -------------------------------------------------------------------------

def cuda_include_dir() -> str:
    """CUDA headers (cuda_bf16.h, ...) for NVRTC, as CuPy finds them."""
    from cuda import pathfinder

    d = pathfinder.find_nvidia_header_directory("cudart")
    if d is None:
        raise RuntimeError("CUDA headers not found; install the cu12 or cu13 extra of moe_rt")
    return str(d)


def compile_offline(file: str, arch: str, names=None) -> tuple[bytes, dict[str, str]]:
    """Compile ``file`` for ``arch`` (e.g. ``"sm_90"``) with NVRTC, without a GPU: the same source and
    options as at run time (plus what CuPy adds). Returns the cubin and the lowered name of each name
    expression; raises RuntimeError with NVRTC's log on failure."""
    from cupy.cuda import nvrtc

    names = list(REGISTRY.get(file, ())) if names is None else list(names)
    opts = list(options()) + [
        f"-I{cuda_include_dir()}",
        f"-arch={arch}",
        "-ftz=true",
        "--device-as-default-execution-space",
    ]
    prog = nvrtc.createProgram(source(file), file, [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed on {file} for {arch}:\n{nvrtc.getProgramLog(prog)}") from e
        cubin = nvrtc.getCUBIN(prog)
        lowered = {n: nvrtc.getLoweredName(prog, n) for n in names}
    finally:
        nvrtc.destroyProgram(prog)
    return cubin, lowered
