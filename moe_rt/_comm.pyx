# cython: language_level=3
"""NCCL, loaded at run time, and the Communicator.

The library is found in this order: ``MOE_RT_NCCL_PATH``; a copy already loaded in the process or the
nvidia-nccl wheel (through cuda.pathfinder, which reuses a loaded copy instead of loading a second one);
then ``libnccl.so.2`` from the system search path. One process uses one copy, so communicators made by
torch or CuPy and ours live in the same library.
"""
from libc.stdint cimport uintptr_t

from moe_rt._nccl cimport *
from libc.string cimport memcpy

import os
import threading

cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char*, int)
    void* dlsym(void*, const char*)
    char* dlerror()
    int RTLD_NOW
    int RTLD_GLOBAL
    int RTLD_NOLOAD


class NcclError(RuntimeError):
    """An NCCL call failed. ``code`` is the ncclResult_t, ``call`` the NCCL function."""

    def __init__(self, call, code, message):
        self.call = call
        self.code = code
        super().__init__(f"{call} failed: {message} (ncclResult_t {code})")


cdef void* _lib = NULL
cdef object _lib_path = None
_lock = threading.Lock()

cdef ncclGetVersion_t p_GetVersion = NULL
cdef ncclGetUniqueId_t p_GetUniqueId = NULL
cdef ncclCommInitRank_t p_CommInitRank = NULL
cdef ncclCommDestroy_t p_CommDestroy = NULL
cdef ncclCommAbort_t p_CommAbort = NULL
cdef ncclCommGetAsyncError_t p_CommGetAsyncError = NULL
cdef ncclCommCount_t p_CommCount = NULL
cdef ncclCommUserRank_t p_CommUserRank = NULL
cdef ncclGetErrorString_t p_GetErrorString = NULL
cdef ncclGetLastError_t p_GetLastError = NULL
cdef ncclGroupStart_t p_GroupStart = NULL
cdef ncclGroupEnd_t p_GroupEnd = NULL
cdef ncclSend_t p_Send = NULL
cdef ncclRecv_t p_Recv = NULL
cdef ncclAllGather_t p_AllGather = NULL
cdef ncclAllReduce_t p_AllReduce = NULL
cdef ncclBroadcast_t p_Broadcast = NULL


cdef void* _sym(const char* name) except NULL:
    cdef void* p = dlsym(_lib, name)
    if p == NULL:
        raise NcclError(name.decode(), -1, f"symbol not found in {_lib_path}")
    return p


cdef void* _open(path) except NULL:
    cdef bytes b = os.fsencode(path)
    cdef void* h = dlopen(b, RTLD_NOW | RTLD_GLOBAL)
    if h == NULL:
        err = dlerror()
        raise OSError(f"cannot load NCCL from {path}: {err.decode() if err != NULL else 'unknown error'}")
    return h


def _find_library():
    env = os.environ.get("MOE_RT_NCCL_PATH")
    if env:
        return env
    try:
        from cuda import pathfinder
        return pathfinder.load_nvidia_dynamic_lib("nccl").abs_path
    except Exception:
        return "libnccl.so.2"


cdef int _ensure_loaded() except -1:
    global _lib, _lib_path
    global p_GetVersion, p_GetUniqueId, p_CommInitRank, p_CommDestroy, p_CommAbort, p_CommGetAsyncError
    global p_CommCount, p_CommUserRank, p_GetErrorString, p_GetLastError, p_GroupStart, p_GroupEnd
    global p_Send, p_Recv, p_AllGather, p_AllReduce, p_Broadcast
    if _lib != NULL:
        return 0
    with _lock:
        if _lib != NULL:
            return 0
        path = _find_library()
        _lib_path = path
        _lib = _open(path)
        p_GetVersion = <ncclGetVersion_t>_sym(b"ncclGetVersion")
        p_GetUniqueId = <ncclGetUniqueId_t>_sym(b"ncclGetUniqueId")
        p_CommInitRank = <ncclCommInitRank_t>_sym(b"ncclCommInitRank")
        p_CommDestroy = <ncclCommDestroy_t>_sym(b"ncclCommDestroy")
        p_CommAbort = <ncclCommAbort_t>_sym(b"ncclCommAbort")
        p_CommGetAsyncError = <ncclCommGetAsyncError_t>_sym(b"ncclCommGetAsyncError")
        p_CommCount = <ncclCommCount_t>_sym(b"ncclCommCount")
        p_CommUserRank = <ncclCommUserRank_t>_sym(b"ncclCommUserRank")
        p_GetErrorString = <ncclGetErrorString_t>_sym(b"ncclGetErrorString")
        p_GetLastError = <ncclGetLastError_t>_sym(b"ncclGetLastError")
        p_GroupStart = <ncclGroupStart_t>_sym(b"ncclGroupStart")
        p_GroupEnd = <ncclGroupEnd_t>_sym(b"ncclGroupEnd")
        p_Send = <ncclSend_t>_sym(b"ncclSend")
        p_Recv = <ncclRecv_t>_sym(b"ncclRecv")
        p_AllGather = <ncclAllGather_t>_sym(b"ncclAllGather")
        p_AllReduce = <ncclAllReduce_t>_sym(b"ncclAllReduce")
        p_Broadcast = <ncclBroadcast_t>_sym(b"ncclBroadcast")
    return 0


cdef str _message(ncclResult_t code, ncclComm_t comm):
    cdef const char* s = p_GetErrorString(code) if p_GetErrorString != NULL else NULL
    msg = s.decode() if s != NULL else "unknown error"
    cdef const char* last
    if p_GetLastError != NULL:
        last = p_GetLastError(comm)
        if last != NULL and last[0] != 0:
            msg += f"; {last.decode()}"
    return msg


cdef inline int _check(ncclResult_t code, const char* call, ncclComm_t comm=NULL) except -1:
    if code != ncclSuccess and code != ncclInProgress:
        raise NcclError(call.decode(), code, _message(code, comm))
    return 0


def error_string(int code):
    """NCCL's text for an ncclResult_t value."""
    _ensure_loaded()
    cdef const char* s = p_GetErrorString(<ncclResult_t>code)
    return s.decode() if s != NULL else "unknown error"


def library_path():
    """Where the loaded NCCL library was found."""
    _ensure_loaded()
    return _lib_path


def nccl_version():
    """The loaded NCCL's version as (major, minor, patch). Works without a GPU."""
    _ensure_loaded()
    cdef int v = 0
    with nogil:
        code = p_GetVersion(&v)
    _check(code, b"ncclGetVersion")
    if v >= 10000:
        return (v // 10000, (v % 10000) // 100, v % 100)
    return (v // 1000, (v % 1000) // 100, v % 100)


def get_unique_id():
    """A fresh 128-byte NCCL unique id (bytes) to share with every rank of a new communicator. Works
    without a GPU."""
    _ensure_loaded()
    cdef ncclUniqueId uid
    cdef ncclResult_t code
    with nogil:
        code = p_GetUniqueId(&uid)
    _check(code, b"ncclGetUniqueId")
    return (<char*>uid.internal)[:NCCL_UNIQUE_ID_BYTES]


_DTYPES = {"int8": ncclInt8, "uint8": ncclUint8, "int32": ncclInt32, "uint32": ncclUint32,
           "int64": ncclInt64, "uint64": ncclUint64, "float16": ncclFloat16, "float32": ncclFloat32,
           "float64": ncclFloat64, "bfloat16": ncclBfloat16}


def nccl_dtype(name):
    """The ncclDataType_t for a dtype name ('float32', 'bfloat16', 'uint8', ...)."""
    try:
        return _DTYPES[str(name)]
    except KeyError:
        raise TypeError(f"no NCCL data type for {name}") from None


cdef class Communicator:
    """An NCCL communicator over ``size`` ranks, one process per GPU.

    ``Communicator(unique_id: bytes, rank: int, size: int, device: int)``: collective over all ranks, which
    pass the same 128-byte id (from :func:`get_unique_id` on one rank). ``close()`` destroys it (a
    collective: every rank must call it); ``abort()`` tears it down at once, for error paths. The finalizer
    aborts a communicator that was never closed, so an exception never leaves NCCL threads behind.
    Data calls take raw device pointers (ints), element counts and a cudaStream_t (int).
    """
    cdef ncclComm_t _comm
    cdef readonly int rank
    cdef readonly int size
    cdef readonly int device
    cdef readonly bint closed

    def __cinit__(self):
        self._comm = NULL
        self.closed = True

    def __init__(self, unique_id, int rank, int size, int device):
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id must be {NCCL_UNIQUE_ID_BYTES} bytes")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        _ensure_loaded()
        import cupy
        cdef ncclUniqueId uid
        cdef bytes b = bytes(unique_id)
        memcpy(uid.internal, <char*>b, NCCL_UNIQUE_ID_BYTES)
        cdef ncclComm_t comm = NULL
        cdef ncclResult_t code
        with cupy.cuda.Device(device):
            with nogil:
                code = p_CommInitRank(&comm, size, uid, rank)
        _check(code, b"ncclCommInitRank")
        self._comm = comm
        self.rank = rank
        self.size = size
        self.device = device
        self.closed = False

    def __dealloc__(self):
        if self._comm != NULL and p_CommAbort != NULL:
            with nogil:
                p_CommAbort(self._comm)
            self._comm = NULL

    cdef ncclComm_t _get(self) except NULL:
        if self._comm == NULL:
            raise ValueError("the communicator is closed")
        return self._comm

    @property
    def ptr(self):
        """The raw ncclComm_t as an int."""
        return <uintptr_t>self._get()

    def close(self):
        """Destroy the communicator (every rank calls it). Idempotent."""
        cdef ncclComm_t c = self._comm
        cdef ncclResult_t code
        if c == NULL:
            return
        self._comm = NULL
        self.closed = True
        with nogil:
            code = p_CommDestroy(c)
        _check(code, b"ncclCommDestroy")

    def abort(self):
        """Tear the communicator down at once, without waiting for peers. Idempotent."""
        cdef ncclComm_t c = self._comm
        if c == NULL:
            return
        self._comm = NULL
        self.closed = True
        with nogil:
            p_CommAbort(c)

    def async_error(self):
        """None while healthy, else an NcclError describing the asynchronous failure."""
        cdef ncclResult_t res = 0
        cdef ncclComm_t c = self._get()
        _check(p_CommGetAsyncError(c, &res), b"ncclCommGetAsyncError", c)
        if res == ncclSuccess or res == ncclInProgress:
            return None
        return NcclError("ncclCommGetAsyncError", res, _message(res, c))

    def group_start(self):
        _check(p_GroupStart(), b"ncclGroupStart")

    def group_end(self):
        cdef ncclResult_t code
        with nogil:
            code = p_GroupEnd()
        _check(code, b"ncclGroupEnd", self._comm)

    def send(self, uintptr_t ptr, size_t count, dtype, int peer, uintptr_t stream):
        cdef int dt = nccl_dtype(dtype)
        cdef ncclComm_t c = self._get()
        cdef ncclResult_t code
        with nogil:
            code = p_Send(<const void*>ptr, count, dt, peer, c, <cudaStream_t>stream)
        _check(code, b"ncclSend", c)

    def recv(self, uintptr_t ptr, size_t count, dtype, int peer, uintptr_t stream):
        cdef int dt = nccl_dtype(dtype)
        cdef ncclComm_t c = self._get()
        cdef ncclResult_t code
        with nogil:
            code = p_Recv(<void*>ptr, count, dt, peer, c, <cudaStream_t>stream)
        _check(code, b"ncclRecv", c)

    def all_gather(self, uintptr_t send, uintptr_t recv, size_t count, dtype, uintptr_t stream):
        """recv[r*count:(r+1)*count] = send of rank r."""
        cdef int dt = nccl_dtype(dtype)
        cdef ncclComm_t c = self._get()
        cdef ncclResult_t code
        with nogil:
            code = p_AllGather(<const void*>send, <void*>recv, count, dt, c, <cudaStream_t>stream)
        _check(code, b"ncclAllGather", c)

    def all_reduce(self, uintptr_t send, uintptr_t recv, size_t count, dtype, uintptr_t stream, op="sum"):
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        cdef int dt = nccl_dtype(dtype)
        cdef int o = ncclSum if op == "sum" else ncclMax
        cdef ncclComm_t c = self._get()
        cdef ncclResult_t code
        with nogil:
            code = p_AllReduce(<const void*>send, <void*>recv, count, dt, o, c, <cudaStream_t>stream)
        _check(code, b"ncclAllReduce", c)

    def broadcast(self, uintptr_t send, uintptr_t recv, size_t count, dtype, int root, uintptr_t stream):
        cdef int dt = nccl_dtype(dtype)
        cdef ncclComm_t c = self._get()
        cdef ncclResult_t code
        with nogil:
            code = p_Broadcast(<const void*>send, <void*>recv, count, dt, root, c, <cudaStream_t>stream)
        _check(code, b"ncclBroadcast", c)

    def __repr__(self):
        state = "closed" if self._comm == NULL else "open"
        return f"Communicator(rank={self.rank}, size={self.size}, device={self.device}, {state})"
