# cython: boundscheck=False, wraparound=False
"""Kernel launches straight to the CUDA driver's ``cuLaunchKernel``.

CuPy's launcher builds a Python object per kernel argument; at the sizes where launch overhead matters
(small batches, a router call every layer) that is most of an op's host time. :func:`launch` packs the
arguments into a stack buffer and calls the driver, which libcuda (``dlopen``'ed on first use, nothing
linked at build time) copies before returning.

Argument types, as the ops pass them: a CuPy array or a moe_rt DevArray (its device pointer), a Python int (a 64-bit value:
pointers and ``long long`` parameters), and NumPy scalars ``int32``, ``uint32``, ``int64``, ``uint64``,
``float32``, ``float64`` (their own width). Any other type makes :func:`launch` return False without
launching, and the caller falls back to CuPy's launcher.
"""
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy

import numpy as np

cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char*, int)
    void* dlsym(void*, const char*)
    int RTLD_NOW
    int RTLD_LOCAL

ctypedef int (*launch_t)(void*, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                         unsigned int, unsigned int, void*, void**, void**) nogil
ctypedef int (*errstr_t)(int, const char**) nogil

cdef enum:
    MAX_ARGS = 48

cdef launch_t _cu_launch = NULL
cdef errstr_t _cu_errstr = NULL
cdef int _state = 0  # 0: not tried, 1: loaded, -1: libcuda not found

cdef object _ndarray = None
cdef object _devarray = None
cdef object _i32 = np.int32
cdef object _u32 = np.uint32
cdef object _i64 = np.int64
cdef object _u64 = np.uint64
cdef object _f32 = np.float32
cdef object _f64 = np.float64


cdef void _set_devarray():
    global _devarray
    from moe_rt._arrays import DevArray
    _devarray = DevArray


cdef int _load():
    global _cu_launch, _cu_errstr, _state, _ndarray
    if _state != 0:
        return _state
    _state = -1
    cdef void* h = dlopen(b"libcuda.so.1", RTLD_NOW | RTLD_LOCAL)
    if h == NULL:
        return _state
    _cu_launch = <launch_t>dlsym(h, b"cuLaunchKernel")
    _cu_errstr = <errstr_t>dlsym(h, b"cuGetErrorString")
    if _cu_launch == NULL:
        return _state
    try:
        import cupy
    except ImportError:
        return _state
    _ndarray = cupy.ndarray
    _set_devarray()
    _state = 1
    return _state


def _bind_context():
    """Make the current device's primary context current on this thread (the runtime does it on a thread's
    first runtime call; the driver's launch needs it already done)."""
    import cupy

    rt = cupy.cuda.runtime
    rt.setDevice(rt.getDevice())


def available():
    """Whether the driver's launcher is usable here (libcuda and CuPy found)."""
    return _load() == 1


cdef int _pack(tuple args, uint64_t* slots, void** params) except -2:
    """Write each argument at the start of its 8-byte slot; -1 for an unsupported type."""
    cdef Py_ssize_t i, n = len(args)
    cdef object a, t
    cdef int32_t v32
    cdef uint32_t u32
    cdef float f32
    cdef double f64
    cdef int64_t v64
    cdef uint64_t u64
    if n > MAX_ARGS:
        return -1
    for i in range(n):
        a = args[i]
        t = type(a)
        slots[i] = 0
        if t is int:
            if a < 0:
                v64 = a
                memcpy(&slots[i], &v64, 8)
            else:
                slots[i] = <uint64_t>a
        elif t is _ndarray:
            slots[i] = <uint64_t>(<uintptr_t>a.data.ptr)
        elif t is _devarray:
            slots[i] = <uint64_t>(<uintptr_t>a.ptr)
        elif t is _i32:
            v32 = a
            memcpy(&slots[i], &v32, 4)
        elif t is _u32:
            u32 = a
            memcpy(&slots[i], &u32, 4)
        elif t is _f32:
            f32 = a
            memcpy(&slots[i], &f32, 4)
        elif t is _i64:
            v64 = a
            memcpy(&slots[i], &v64, 8)
        elif t is _u64:
            u64 = a
            memcpy(&slots[i], &u64, 8)
        elif t is _f64:
            f64 = a
            memcpy(&slots[i], &f64, 8)
        else:
            return -1
        params[i] = &slots[i]
    return 0


def pack(tuple args):
    """The bytes :func:`launch` hands the driver for ``args`` (8 per argument, value first, little endian),
    or None if an argument type is not supported. For tests."""
    cdef uint64_t slots[MAX_ARGS]
    cdef void* params[MAX_ARGS]
    global _ndarray
    if _ndarray is None:
        try:
            import cupy
            _ndarray = cupy.ndarray
        except ImportError:
            pass
    if _devarray is None:
        _set_devarray()
    if _pack(args, slots, params) != 0:
        return None
    return bytes((<char*>slots)[:8 * len(args)])


def launch(uintptr_t function, grid, block, tuple args, uintptr_t stream, unsigned int shared_mem=0):
    """Launch the CUfunction ``function`` (CuPy ``Function.ptr``) on ``stream`` (a cudaStream_t).
    ``grid`` and ``block``: an int or a tuple of up to 3 ints. Returns False, launching nothing, when the
    driver is unavailable or an argument type is not supported; raises RuntimeError on a driver error."""
    cdef uint64_t slots[MAX_ARGS]
    cdef void* params[MAX_ARGS]
    cdef unsigned int g[3]
    cdef unsigned int b[3]
    cdef int k
    if _state != 1 and _load() != 1:
        return False
    if _pack(args, slots, params) != 0:
        return False
    g[0] = g[1] = g[2] = 1
    b[0] = b[1] = b[2] = 1
    if isinstance(grid, tuple):
        for k in range(min(len(grid), 3)):
            g[k] = grid[k]
    else:
        g[0] = grid
    if isinstance(block, tuple):
        for k in range(min(len(block), 3)):
            b[k] = block[k]
    else:
        b[0] = block
    _go(<void*>function, g, b, shared_mem, <void*>stream, params, len(args))
    return True


cdef int _go(void* function, unsigned int* g, unsigned int* b, unsigned int shared_mem, void* stream,
             void** params, int nargs) except -1:
    """One cuLaunchKernel; raises RuntimeError on a driver error."""
    cdef int r
    cdef const char* msg = NULL
    with nogil:
        r = _cu_launch(function, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, stream, params, NULL)
    if r == 201:  # CUDA_ERROR_INVALID_CONTEXT: a thread that has not used CUDA yet (an autograd worker)
        _bind_context()
        with nogil:
            r = _cu_launch(function, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, stream, params, NULL)
    if r != 0:
        if _cu_errstr != NULL:
            _cu_errstr(r, &msg)
        text = msg.decode() if msg != NULL else "unknown error"
        raise RuntimeError(f"cuLaunchKernel failed with CUDA error {r}: {text} (grid {(g[0], g[1], g[2])}, "
                           f"block {(b[0], b[1], b[2])}, {shared_mem} bytes of shared memory)")
    return 0
