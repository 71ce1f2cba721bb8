# cython: language_level=3
"""NCCL and the Communicator: a thin layer over the C core's communicator (csrc/comm.c, the "NCCL and the
communicator" part of include/moe_rt/moe_rt.h), where NCCL is loaded at run time and called.

The library is found in this order: ``MOE_RT_NCCL_PATH``; a copy already loaded in the process or the
nvidia-nccl wheel (through cuda.pathfinder, which reuses a loaded copy instead of loading a second one);
then ``libnccl.so.2`` from the system search path. The path found here is handed to the core
(``moe_rt_nccl_load``), which opens it once for the process. One process uses one copy, so communicators
made by torch or CuPy and ours live in the same library.
"""
from libc.stdint cimport int64_t, uintptr_t
from libc.stddef cimport size_t

import os
import threading

from moe_rt._core import DTYPE_CODES, lib_symbol

cdef extern from "moe_rt/moe_rt.h" nogil:
    ctypedef struct moe_rt_comm:
        pass
    ctypedef struct moe_rt_nccl_failure:
        int result
        char call[64]
        char message[1024]

ctypedef int (*f_load)(const char*) noexcept nogil
ctypedef int (*f_path)(const char**) noexcept nogil
ctypedef int (*f_version)(int*, int*, int*) noexcept nogil
ctypedef int (*f_error_string)(int, const char**) noexcept nogil
ctypedef int (*f_last_failure)(moe_rt_nccl_failure*) noexcept nogil
ctypedef int (*f_dtype)(int, int*) noexcept nogil
ctypedef int (*f_unique_id)(void*) noexcept nogil
ctypedef int (*f_init_rank)(const void*, int, int, moe_rt_comm**) noexcept nogil
ctypedef int (*f_comm)(moe_rt_comm*) noexcept nogil
ctypedef int (*f_aborted)(const moe_rt_comm*, int*) noexcept nogil
ctypedef int (*f_async_error)(moe_rt_comm*, int*, char*, size_t) noexcept nogil
ctypedef int (*f_handle)(const moe_rt_comm*, void**) noexcept nogil
ctypedef int (*f_group_start)() noexcept nogil
ctypedef int (*f_group_end)(const moe_rt_comm*) noexcept nogil
ctypedef int (*f_p2p)(moe_rt_comm*, void*, int64_t, int, int, void*) noexcept nogil
ctypedef int (*f_all_gather)(moe_rt_comm*, const void*, void*, int64_t, int, void*) noexcept nogil
ctypedef int (*f_rooted)(moe_rt_comm*, const void*, void*, int64_t, int, int, void*) noexcept nogil
ctypedef const char* (*f_last_error)() noexcept nogil

cdef f_load p_load
cdef f_path p_path
cdef f_version p_version
cdef f_error_string p_error_string
cdef f_last_failure p_last_failure
cdef f_dtype p_dtype
cdef f_unique_id p_unique_id
cdef f_init_rank p_init_rank
cdef f_comm p_destroy
cdef f_comm p_abort
cdef f_aborted p_aborted
cdef f_async_error p_async_error
cdef f_handle p_handle
cdef f_group_start p_group_start
cdef f_group_end p_group_end
cdef f_p2p p_send
cdef f_p2p p_recv
cdef f_all_gather p_all_gather
cdef f_rooted p_all_reduce
cdef f_rooted p_broadcast
cdef f_last_error p_last_error

# moe_rt_status values (include/moe_rt/moe_rt.h)
cdef enum:
    INVALID_ARGUMENT = 1
    NO_NCCL = 8
    NCCL = 9
    UNIQUE_ID_BYTES = 128
    REDUCE_SUM = 0
    REDUCE_MAX = 1


cdef void* _sym(bytes name) except NULL:
    return <void*><uintptr_t>lib_symbol(name)  # from the library moe_rt._core opened


cdef _open():
    global p_load, p_path, p_version, p_error_string, p_last_failure, p_dtype, p_unique_id, p_init_rank
    global p_destroy, p_abort, p_aborted, p_async_error, p_handle, p_group_start, p_group_end, p_send, p_recv
    global p_all_gather, p_all_reduce, p_broadcast, p_last_error
    p_load = <f_load>_sym(b"moe_rt_nccl_load")
    p_path = <f_path>_sym(b"moe_rt_nccl_library_path")
    p_version = <f_version>_sym(b"moe_rt_nccl_version")
    p_error_string = <f_error_string>_sym(b"moe_rt_nccl_error_string")
    p_last_failure = <f_last_failure>_sym(b"moe_rt_nccl_last_failure")
    p_dtype = <f_dtype>_sym(b"moe_rt_nccl_dtype")
    p_unique_id = <f_unique_id>_sym(b"moe_rt_nccl_get_unique_id")
    p_init_rank = <f_init_rank>_sym(b"moe_rt_comm_init_rank")
    p_destroy = <f_comm>_sym(b"moe_rt_comm_destroy")
    p_abort = <f_comm>_sym(b"moe_rt_comm_abort")
    p_aborted = <f_aborted>_sym(b"moe_rt_comm_aborted")
    p_async_error = <f_async_error>_sym(b"moe_rt_comm_async_error")
    p_handle = <f_handle>_sym(b"moe_rt_comm_nccl_handle")
    p_group_start = <f_group_start>_sym(b"moe_rt_comm_group_start")
    p_group_end = <f_group_end>_sym(b"moe_rt_comm_group_end")
    p_send = <f_p2p>_sym(b"moe_rt_comm_send")
    p_recv = <f_p2p>_sym(b"moe_rt_comm_recv")
    p_all_gather = <f_all_gather>_sym(b"moe_rt_comm_all_gather")
    p_all_reduce = <f_rooted>_sym(b"moe_rt_comm_all_reduce")
    p_broadcast = <f_rooted>_sym(b"moe_rt_comm_broadcast")
    p_last_error = <f_last_error>_sym(b"moe_rt_last_error")


_open()


class NcclError(RuntimeError):
    """An NCCL call failed. ``code`` is the ncclResult_t, ``call`` the NCCL function."""

    def __init__(self, call, code, message):
        self.call = call
        self.code = code
        super().__init__(f"{call} failed: {message} (ncclResult_t {code})")


cdef object _error(int status):
    """The exception of a core status: NcclError for an NCCL call that failed (or a function the library
    lacks), OSError when NCCL cannot be loaded, ValueError for a bad argument (the core's message names it)."""
    cdef moe_rt_nccl_failure f
    msg = p_last_error().decode(errors="replace")
    p_last_failure(&f)
    if (status == NCCL or status == NO_NCCL) and f.call[0] != 0:
        return NcclError(f.call.decode(), f.result, f.message.decode(errors="replace"))
    if status == NO_NCCL:
        return OSError(msg)
    if status == INVALID_ARGUMENT:
        return ValueError(msg)
    return RuntimeError(f"moe_rt: {msg}")


cdef inline int _check(int status) except -1:
    if status != 0:
        raise _error(status)
    return 0


cdef bint _loaded = False
_lock = threading.Lock()


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
    global _loaded
    if _loaded:
        return 0
    with _lock:
        if _loaded:
            return 0
        _check(p_load(os.fsencode(_find_library())))
        _loaded = True
    return 0


def error_string(int code):
    """NCCL's text for an ncclResult_t value."""
    _ensure_loaded()
    cdef const char* s = NULL
    _check(p_error_string(code, &s))
    return s.decode()


def library_path():
    """Where the loaded NCCL library was found."""
    _ensure_loaded()
    cdef const char* s = NULL
    _check(p_path(&s))
    cdef bytes b = s
    return os.fsdecode(b)


def nccl_version():
    """The loaded NCCL's version as (major, minor, patch). Works without a GPU."""
    _ensure_loaded()
    cdef int major = 0, minor = 0, patch = 0
    cdef int st
    with nogil:
        st = p_version(&major, &minor, &patch)
    _check(st)
    return (major, minor, patch)


def get_unique_id():
    """A fresh 128-byte NCCL unique id (bytes) to share with every rank of a new communicator. Works
    without a GPU."""
    _ensure_loaded()
    cdef char uid[UNIQUE_ID_BYTES]
    cdef int st
    with nogil:
        st = p_unique_id(uid)
    _check(st)
    return uid[:UNIQUE_ID_BYTES]


# moe_rt_dtype codes (include/moe_rt/moe_rt.h) of the dtypes NCCL moves, by name (the core maps them to NCCL's)
_CODES = {**{n: DTYPE_CODES[n] for n in ("int8", "uint8", "int32", "int64", "float16", "float32", "bfloat16")},
          "uint32": 11, "uint64": 12, "float64": 13}


cdef int _code(dtype) except -1:
    code = _CODES.get(dtype) if type(dtype) is str else _CODES.get(str(dtype))
    if code is None:
        raise TypeError(f"no NCCL data type for {dtype}")
    return code


def nccl_dtype(name):
    """The ncclDataType_t for a dtype name ('float32', 'bfloat16', 'uint8', ...)."""
    cdef int t = 0
    _check(p_dtype(_code(name), &t))
    return t


cdef class Communicator:
    """An NCCL communicator over ``size`` ranks, one process per GPU.

    ``Communicator(unique_id: bytes, rank: int, size: int, device: int)``: collective over all ranks, which
    pass the same 128-byte id (from :func:`get_unique_id` on one rank). ``close()`` destroys it (a
    collective: every rank must call it); ``abort()`` tears it down at once, for error paths. The finalizer
    aborts a communicator that was never closed, so an exception never leaves NCCL threads behind.
    Data calls take raw device pointers (ints), element counts and a cudaStream_t (int).
    """
    cdef moe_rt_comm* _comm
    cdef readonly int rank
    cdef readonly int size
    cdef readonly int device
    cdef readonly bint closed

    def __cinit__(self):
        self._comm = NULL
        self.closed = True

    def __init__(self, unique_id, int rank, int size, int device):
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id must be {UNIQUE_ID_BYTES} bytes")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        _ensure_loaded()
        import cupy
        cdef bytes b = bytes(unique_id)
        cdef const char* uid = b
        cdef moe_rt_comm* comm = NULL
        cdef int st
        with cupy.cuda.Device(device):
            with nogil:
                st = p_init_rank(uid, size, rank, &comm)
        _check(st)
        self._comm = comm
        self.rank = rank
        self.size = size
        self.device = device
        self.closed = False

    def __dealloc__(self):
        if self._comm != NULL:
            with nogil:
                p_abort(self._comm)
            self._comm = NULL

    cdef moe_rt_comm* _get(self) except NULL:
        if self._comm == NULL:
            raise ValueError("the communicator is closed")
        return self._comm

    @property
    def ptr(self):
        """The raw ncclComm_t as an int."""
        cdef void* h = NULL
        _check(p_handle(self._get(), &h))
        return <uintptr_t>h

    @property
    def handle(self):
        """The core's moe_rt_comm* as an int (for the C ABI; valid until close or abort)."""
        return <uintptr_t>self._get()

    def close(self):
        """Destroy the communicator (every rank calls it). Idempotent. Release every CUDA graph that captured
        its collectives first (an EP group's NCCL transport): from NCCL 2.26 the destruction waits until each
        such graph is destroyed."""
        cdef moe_rt_comm* c = self._comm
        cdef int st
        if c == NULL:
            return
        self._comm = NULL
        self.closed = True
        with nogil:
            st = p_destroy(c)
        _check(st)

    def abort(self):
        """Tear the communicator down at once, without waiting for peers. Idempotent."""
        cdef moe_rt_comm* c = self._comm
        if c == NULL:
            return
        self._comm = NULL
        self.closed = True
        with nogil:
            p_abort(c)

    def release_if_aborted(self):
        """After a core call that waits with a deadline (moe_rt_peer_buffer_create): if the core aborted the
        communicator (a timeout or an NCCL error met while waiting; moe_rt_comm_aborted), release it as
        :meth:`abort` does and return True; else False."""
        cdef int aborted = 0
        if self._comm == NULL:
            return False
        _check(p_aborted(self._comm, &aborted))
        if aborted:
            self.abort()
        return bool(aborted)

    def async_error(self):
        """None while healthy, else an NcclError describing the asynchronous failure."""
        cdef int res = 0
        cdef char msg[1024]
        _check(p_async_error(self._get(), &res, msg, sizeof(msg)))
        if res == 0 or res == 7:  # ncclSuccess, ncclInProgress
            return None
        return NcclError("ncclCommGetAsyncError", res, msg.decode(errors="replace"))

    def group_start(self):
        _check(p_group_start())

    def group_end(self):
        cdef int st
        with nogil:
            st = p_group_end(self._comm)
        _check(st)

    def send(self, uintptr_t ptr, size_t count, dtype, int peer, uintptr_t stream):
        cdef int dt = _code(dtype)
        cdef moe_rt_comm* c = self._get()
        cdef int st
        with nogil:
            st = p_send(c, <void*>ptr, <int64_t>count, dt, peer, <void*>stream)
        _check(st)

    def recv(self, uintptr_t ptr, size_t count, dtype, int peer, uintptr_t stream):
        cdef int dt = _code(dtype)
        cdef moe_rt_comm* c = self._get()
        cdef int st
        with nogil:
            st = p_recv(c, <void*>ptr, <int64_t>count, dt, peer, <void*>stream)
        _check(st)

    def all_gather(self, uintptr_t send, uintptr_t recv, size_t count, dtype, uintptr_t stream):
        """recv[r*count:(r+1)*count] = send of rank r."""
        cdef int dt = _code(dtype)
        cdef moe_rt_comm* c = self._get()
        cdef int st
        with nogil:
            st = p_all_gather(c, <const void*>send, <void*>recv, <int64_t>count, dt, <void*>stream)
        _check(st)

    def all_reduce(self, uintptr_t send, uintptr_t recv, size_t count, dtype, uintptr_t stream, op="sum"):
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        cdef int dt = _code(dtype)
        cdef int o = REDUCE_SUM if op == "sum" else REDUCE_MAX
        cdef moe_rt_comm* c = self._get()
        cdef int st
        with nogil:
            st = p_all_reduce(c, <const void*>send, <void*>recv, <int64_t>count, dt, o, <void*>stream)
        _check(st)

    def broadcast(self, uintptr_t send, uintptr_t recv, size_t count, dtype, int root, uintptr_t stream):
        cdef int dt = _code(dtype)
        cdef moe_rt_comm* c = self._get()
        cdef int st
        with nogil:
            st = p_broadcast(c, <const void*>send, <void*>recv, <int64_t>count, dt, root, <void*>stream)
        _check(st)

    def __repr__(self):
        state = "closed" if self._comm == NULL else "open"
        return f"Communicator(rank={self.rank}, size={self.size}, device={self.device}, {state})"
