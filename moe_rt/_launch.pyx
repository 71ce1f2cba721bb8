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

:class:`Launches` holds a recorded sequence of launches (see ``moe_rt._fast``) with its constant arguments
packed once; :meth:`Launches.run` writes each call's pointers into the packed arguments and launches, with
no Python work per argument.
"""
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

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
cdef int _fake_nargs = 0  # arguments of the launch under way, for the tests' stand-in driver

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
    global _fake_nargs
    _fake_nargs = nargs
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


cdef int _dims(object d, unsigned int* out) except -1:
    out[0] = out[1] = out[2] = 1
    cdef int k
    if isinstance(d, tuple):
        if len(d) > 3:
            raise ValueError(f"a launch dimension of more than 3 entries: {d}")
        for k in range(len(d)):
            out[k] = d[k]
    else:
        out[0] = d
    return 0


cdef struct _Rec:
    void* fn
    unsigned int g[3]
    unsigned int b[3]
    unsigned int smem
    int nargs
    int nrefs
    uint64_t slots[MAX_ARGS]  # the constant arguments, packed; pointer slots filled per call
    int ref_pos[MAX_ARGS]
    Py_ssize_t ref_key[MAX_ARGS]
    int64_t ref_off[MAX_ARGS]


cdef class Launches:
    """A sequence of launches, each ``(function pointer, grid, block, shared memory, arguments, refs)``:
    ``arguments`` a tuple of the types :func:`launch` takes, its pointer positions to be filled per call,
    ``refs`` a tuple of ``(position, key, offset)``, the argument at ``position`` being ``ptrs[key] +
    offset`` for the ``ptrs`` of each :meth:`run`. Raises ValueError for an argument type :func:`launch`
    does not take or a position or key out of range."""

    cdef _Rec* recs
    cdef int n

    def __cinit__(self, launches):
        cdef void* params[MAX_ARGS]
        cdef _Rec* r
        cdef int i, j
        launches = tuple(launches)
        self.n = 0
        self.recs = <_Rec*>malloc(max(len(launches), 1) * sizeof(_Rec))
        if self.recs == NULL:
            raise MemoryError()
        for i in range(len(launches)):
            fptr, grid, block, smem, tmpl, refs = launches[i]
            r = &self.recs[i]
            memset(r, 0, sizeof(_Rec))
            tmpl = tuple(tmpl)
            if _pack(tmpl, r.slots, params) != 0:
                raise ValueError("moe_rt: a launch argument type the driver launcher does not take")
            r.fn = <void*><uintptr_t>fptr
            _dims(grid, r.g)
            _dims(block, r.b)
            r.smem = smem
            r.nargs = len(tmpl)
            if len(refs) > r.nargs:
                raise ValueError("moe_rt: more pointer refs than arguments")
            r.nrefs = len(refs)
            for j in range(r.nrefs):
                pos, key, off = refs[j]
                if not 0 <= pos < r.nargs or key < 0:
                    raise ValueError(f"moe_rt: a pointer ref out of range: {refs[j]}")
                r.ref_pos[j] = pos
                r.ref_key[j] = key
                r.ref_off[j] = off
            self.n = i + 1

    def __dealloc__(self):
        free(self.recs)

    def __len__(self):
        return self.n

    def run(self, ptrs, uintptr_t stream):
        """Launch each on ``stream`` with ``ptrs[key]`` (an int, any container indexed by the refs' keys)
        in its pointer slots. Returns False, launching nothing, when the driver is unavailable."""
        cdef uint64_t slots[MAX_ARGS]
        cdef void* params[MAX_ARGS]
        cdef _Rec* r
        cdef int i, j
        if _state != 1 and _load() != 1:
            return False
        for j in range(MAX_ARGS):
            params[j] = &slots[j]
        for i in range(self.n):
            r = &self.recs[i]
            memcpy(slots, r.slots, 8 * r.nargs)
            for j in range(r.nrefs):
                slots[r.ref_pos[j]] = <uint64_t>(ptrs[r.ref_key[j]]) + <uint64_t>r.ref_off[j]
            _go(r.fn, r.g, r.b, r.smem, <void*>stream, params, r.nargs)
        return True


# -- a stand-in for cuLaunchKernel, for tests on machines without a GPU ---------------------------------

cdef enum:
    FAKE_MAX = 1024

cdef int _fake_n = 0
cdef uint64_t _fake_args[FAKE_MAX][MAX_ARGS]
cdef uint64_t _fake_meta[FAKE_MAX][10]  # function, grid x3, block x3, shared memory, stream, argument count
cdef launch_t _saved_launch = NULL
cdef int _saved_state = 0


cdef int _fake_launch(void* f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                      unsigned int by, unsigned int bz, unsigned int smem, void* stream, void** params,
                      void** extra) noexcept nogil:
    global _fake_n
    cdef int j
    if _fake_n >= FAKE_MAX or _fake_nargs > MAX_ARGS:
        return 1  # CUDA_ERROR_INVALID_VALUE
    for j in range(_fake_nargs):
        _fake_args[_fake_n][j] = (<uint64_t*>params[j])[0]
    _fake_meta[_fake_n][0] = <uint64_t><uintptr_t>f
    _fake_meta[_fake_n][1] = gx
    _fake_meta[_fake_n][2] = gy
    _fake_meta[_fake_n][3] = gz
    _fake_meta[_fake_n][4] = bx
    _fake_meta[_fake_n][5] = by
    _fake_meta[_fake_n][6] = bz
    _fake_meta[_fake_n][7] = smem
    _fake_meta[_fake_n][8] = <uint64_t><uintptr_t>stream
    _fake_meta[_fake_n][9] = _fake_nargs
    _fake_n += 1
    return 0


def _fake_driver(bint on):
    """Tests: ``True`` puts a recorder in place of cuLaunchKernel (nothing is launched, no GPU needed);
    ``False`` puts the driver back. Both return the launches recorded since the last call, each
    ``(function, grid, block, shared memory, stream, packed arguments)`` as :func:`pack` writes them."""
    global _cu_launch, _state, _fake_n, _saved_launch, _saved_state
    cdef int i, j
    out = []
    for i in range(_fake_n):
        m = _fake_meta[i]
        out.append((m[0], (m[1], m[2], m[3]), (m[4], m[5], m[6]), m[7], m[8],
                    bytes((<char*>_fake_args[i])[:8 * m[9]])))
    _fake_n = 0
    if on and _cu_launch != <launch_t>_fake_launch:
        _saved_launch, _saved_state = _cu_launch, _state
        _cu_launch, _state = <launch_t>_fake_launch, 1
        _set_devarray()
    elif not on and _cu_launch == <launch_t>_fake_launch:
        _cu_launch, _state = _saved_launch, _saved_state
    return out
