# cython: language_level=3
"""DLPack consumer and producer.

``consume(obj, stream)`` takes any object with ``__dlpack__`` (torch, JAX, CuPy, NumPy, ...) and returns a
:class:`Imported` view: pointer, shape, element strides, dtype, device, read-only flag. The view owns the
producer's managed tensor and releases it when the view dies, so keeping the view alive keeps the memory
alive. ``Exported`` is the producer side: it wraps an array (anything with a pointer, shape and strides)
and hands it out through ``__dlpack__``, versioned when the consumer asks for it, bf16 included (NumPy
cannot export bf16 itself).
"""
from cpython.pycapsule cimport (PyCapsule_GetName, PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New,
                                PyCapsule_SetName)
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_FillInfo
from libc.stdint cimport int64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport strcmp

import numpy as np
import ml_dtypes

DEVICE_CPU = kDLCPU
DEVICE_CUDA = kDLCUDA
DEVICE_CUDA_HOST = kDLCUDAHost
DEVICE_CUDA_MANAGED = kDLCUDAManaged

_DEVICE_NAMES = {kDLCPU: "cpu", kDLCUDA: "cuda", kDLCUDAHost: "cuda_host", kDLCUDAManaged: "cuda_managed"}

# (code, bits) -> numpy dtype. bf16 and fp8 come from ml_dtypes.
_TO_NUMPY = {
    (kDLFloat, 16): np.dtype(np.float16),
    (kDLFloat, 32): np.dtype(np.float32),
    (kDLFloat, 64): np.dtype(np.float64),
    (kDLBfloat, 16): np.dtype(ml_dtypes.bfloat16),
    (kDLInt, 8): np.dtype(np.int8),
    (kDLInt, 16): np.dtype(np.int16),
    (kDLInt, 32): np.dtype(np.int32),
    (kDLInt, 64): np.dtype(np.int64),
    (kDLUInt, 8): np.dtype(np.uint8),
    (kDLUInt, 16): np.dtype(np.uint16),
    (kDLUInt, 32): np.dtype(np.uint32),
    (kDLUInt, 64): np.dtype(np.uint64),
    (kDLBool, 8): np.dtype(np.bool_),
    (kDLFloat8_e4m3fn, 8): np.dtype(ml_dtypes.float8_e4m3fn),
    (kDLFloat8_e5m2, 8): np.dtype(ml_dtypes.float8_e5m2),
}
_FROM_NUMPY = {v: k for k, v in _TO_NUMPY.items()}

_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque", 4: "bfloat", 5: "complex", 6: "bool"}


def dtype_from_dlpack(int code, int bits, int lanes):
    """The NumPy dtype for a DLPack (code, bits, lanes) triple; TypeError if moe_rt does not take it."""
    if lanes != 1:
        raise TypeError(f"DLPack vector dtypes (lanes={lanes}) are not supported")
    try:
        return _TO_NUMPY[(code, bits)]
    except KeyError:
        name = _CODE_NAMES.get(code, f"code {code}")
        raise TypeError(f"DLPack dtype {name}{bits} is not supported") from None


cdef class Imported:
    """A consumed DLPack tensor. Attributes: ``ptr`` (int, byte offset applied), ``shape`` and ``strides``
    (tuples, strides in elements), ``dtype`` (NumPy dtype), ``device_type`` ('cpu' or 'cuda'),
    ``device_id``, ``readonly``, ``versioned`` and ``span`` (bytes between the lowest and one past the
    highest addressed byte)."""
    cdef readonly object ptr
    cdef readonly tuple shape
    cdef readonly tuple strides
    cdef readonly object dtype
    cdef readonly str device_type
    cdef readonly int device_id
    cdef readonly bint readonly
    cdef readonly bint versioned
    cdef readonly object span
    cdef void* _managed
    cdef bint _is_versioned

    def __cinit__(self):
        self._managed = NULL

    def __dealloc__(self):
        cdef DLManagedTensor* m
        cdef DLManagedTensorVersioned* mv
        if self._managed == NULL:
            return
        if self._is_versioned:
            mv = <DLManagedTensorVersioned*>self._managed
            if mv.deleter != NULL:
                mv.deleter(mv)
        else:
            m = <DLManagedTensor*>self._managed
            if m.deleter != NULL:
                m.deleter(m)
        self._managed = NULL

    @property
    def size(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_c_contiguous(self):
        expected = 1
        for dim, st in zip(reversed(self.shape), reversed(self.strides)):
            if dim > 1 and st != expected:
                return False
            expected *= dim
        return True

    def __repr__(self):
        return (f"Imported(shape={self.shape}, dtype={self.dtype}, device={self.device_type}:{self.device_id}, "
                f"strides={self.strides})")


cdef _fill(Imported view, DLTensor* t):
    cdef int i
    cdef int64_t lo = 0, hi = 0
    if t.device.device_type == kDLCPU or t.device.device_type == kDLCUDAHost:
        view.device_type = "cpu"
    elif t.device.device_type == kDLCUDA or t.device.device_type == kDLCUDAManaged:
        view.device_type = "cuda"
    else:
        raise TypeError(f"DLPack device type {t.device.device_type} is not supported (CPU and CUDA only)")
    view.device_id = t.device.device_id
    if t.ndim < 0:
        raise ValueError(f"DLPack tensor has a negative ndim ({t.ndim})")
    view.dtype = dtype_from_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides == NULL:  # compact row-major (allowed before DLPack 1.2)
        strides = []
        acc = 1
        for d in reversed(shape):
            strides.append(acc)
            acc *= d
        strides = tuple(reversed(strides))
    else:
        strides = tuple(t.strides[i] for i in range(t.ndim))
    view.shape = shape
    view.strides = strides
    itemsize = view.dtype.itemsize
    if any(d == 0 for d in shape):
        view.span = 0
    else:
        for d, s in zip(shape, strides):
            if s >= 0:
                hi += (d - 1) * s
            else:
                lo += (d - 1) * s
        if lo < 0:
            raise ValueError("DLPack tensors with negative strides are not supported")
        view.span = (hi + 1) * itemsize
    view.ptr = <uintptr_t>t.data + t.byte_offset


def consume(obj, stream=None):
    """Import ``obj`` through its ``__dlpack__``. ``stream`` is the consumer stream as an int (CUDA: 1 =
    legacy default stream, 2 = per-thread default, else a cudaStream_t) or None; it is passed to the
    producer only for CUDA tensors, so the producer orders its pending writes before that stream."""
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(f"expected an array with __dlpack__ (torch, JAX, CuPy, NumPy), got {type(obj).__name__}")
    dev_type = None
    if hasattr(obj, "__dlpack_device__"):
        dev_type = int(obj.__dlpack_device__()[0])
    kwargs = {}
    if dev_type in (kDLCUDA, kDLCUDAManaged) and stream is not None:
        kwargs["stream"] = int(stream)
    # Newest protocol first; older producers reject max_version (and a few reject stream) with TypeError.
    attempts = [dict(kwargs, max_version=(1, 0)), kwargs] + ([{}] if kwargs else [])
    for i, kw in enumerate(attempts):
        try:
            capsule = obj.__dlpack__(**kw)
            break
        except TypeError:
            if i == len(attempts) - 1:
                raise
    return consume_capsule(capsule)


def consume_capsule(capsule):
    """Import a DLPack capsule ("dltensor" or "dltensor_versioned"); the capsule is marked used."""
    cdef Imported view = Imported()
    cdef DLManagedTensor* m
    cdef DLManagedTensorVersioned* mv
    cdef object c = capsule
    if PyCapsule_IsValid(c, b"dltensor_versioned"):
        mv = <DLManagedTensorVersioned*>PyCapsule_GetPointer(c, b"dltensor_versioned")
        if mv.version.major != 1:
            raise BufferError(f"DLPack version {mv.version.major}.{mv.version.minor} is not supported "
                              "(major version 1 expected)")
        PyCapsule_SetName(c, b"used_dltensor_versioned")
        view._managed = mv
        view._is_versioned = True
        view.versioned = True
        view.readonly = (mv.flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0
        _fill(view, &mv.dl_tensor)
    elif PyCapsule_IsValid(c, b"dltensor"):
        m = <DLManagedTensor*>PyCapsule_GetPointer(c, b"dltensor")
        PyCapsule_SetName(c, b"used_dltensor")
        view._managed = m
        view._is_versioned = False
        view.versioned = False
        view.readonly = False
        _fill(view, &m.dl_tensor)
    else:
        raise TypeError("expected an unused DLPack capsule named 'dltensor' or 'dltensor_versioned'")
    return view


cdef class HostBuffer:
    """Exposes ``nbytes`` bytes of host memory at ``ptr`` through the buffer protocol while keeping
    ``owner`` alive, so NumPy can view memory imported through DLPack without copying."""
    cdef uintptr_t _ptr
    cdef Py_ssize_t _nbytes
    cdef bint _readonly
    cdef object _owner

    def __cinit__(self, ptr, nbytes, owner, readonly=False):
        self._ptr = ptr
        self._nbytes = nbytes
        self._owner = owner
        self._readonly = readonly

    def __getbuffer__(self, Py_buffer* buf, int flags):
        if self._readonly and (flags & PyBUF_WRITABLE):
            raise BufferError("the imported tensor is read-only")
        PyBuffer_FillInfo(buf, self, <void*>self._ptr, self._nbytes, self._readonly, flags)

    def __releasebuffer__(self, Py_buffer* buf):
        pass


# ---- producer ------------------------------------------------------------------------------------

cdef struct _ExportCtx:
    PyObject* owner
    int64_t* shape_strides


cdef void _versioned_deleter(DLManagedTensorVersioned* m) noexcept with gil:
    cdef _ExportCtx* ctx = <_ExportCtx*>m.manager_ctx
    Py_DECREF(<object>ctx.owner)
    free(ctx.shape_strides)
    free(ctx)
    free(m)


cdef void _legacy_deleter(DLManagedTensor* m) noexcept with gil:
    cdef _ExportCtx* ctx = <_ExportCtx*>m.manager_ctx
    Py_DECREF(<object>ctx.owner)
    free(ctx.shape_strides)
    free(ctx)
    free(m)


cdef void _versioned_capsule_destructor(object capsule) noexcept:
    cdef DLManagedTensorVersioned* m
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):  # never consumed
        m = <DLManagedTensorVersioned*>PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        m.deleter(m)


cdef void _legacy_capsule_destructor(object capsule) noexcept:
    cdef DLManagedTensor* m
    if PyCapsule_IsValid(capsule, b"dltensor"):
        m = <DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor")
        m.deleter(m)


cdef _fill_tensor(DLTensor* t, int64_t* buf, ptr, shape, strides, dtype, int dev_type, int dev_id):
    cdef int n = len(shape)
    cdef int i
    code, bits = _FROM_NUMPY[np.dtype(dtype)]
    t.data = <void*><uintptr_t>ptr
    t.device.device_type = dev_type
    t.device.device_id = dev_id
    t.ndim = n
    t.dtype.code = code
    t.dtype.bits = bits
    t.dtype.lanes = 1
    for i in range(n):
        buf[i] = shape[i]
        buf[n + i] = strides[i]
    t.shape = buf
    t.strides = buf + n
    t.byte_offset = 0


cdef class Exported:
    """Hands an array out through ``__dlpack__``. ``ptr``: data address; ``shape``; ``strides`` in
    elements; ``dtype``: a NumPy dtype (bf16/fp8 from ml_dtypes allowed); ``device``: ('cpu', 0) or
    ('cuda', id); ``owner``: kept alive until every consumer has released the memory."""
    cdef object ptr, shape, strides, dtype, owner
    cdef int dev_type, dev_id
    cdef bint readonly

    def __init__(self, ptr, shape, strides, dtype, device, owner, readonly=False):
        kind, dev_id = device
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {kind!r}")
        dt = np.dtype(dtype)
        if dt not in _FROM_NUMPY:
            raise TypeError(f"dtype {dt} cannot be exported through DLPack")
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(int(s) for s in strides)
        self.dtype = dt
        self.owner = owner
        self.dev_type = kDLCPU if kind == "cpu" else kDLCUDA
        self.dev_id = dev_id
        self.readonly = readonly

    @staticmethod
    def from_numpy(arr):
        """Export a NumPy array (any dtype moe_rt knows, bf16 included) without copying."""
        arr = np.asarray(arr)
        st = tuple(s // arr.itemsize for s in arr.strides) if arr.size else (0,) * arr.ndim
        return Exported(arr.ctypes.data, arr.shape, st, arr.dtype, ("cpu", 0), arr,
                        readonly=not arr.flags.writeable)

    def __dlpack_device__(self):
        return (self.dev_type, self.dev_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        cdef DLManagedTensorVersioned* mv
        cdef DLManagedTensor* m
        cdef _ExportCtx* ctx
        cdef int n = len(self.shape)
        if copy:
            raise BufferError("moe_rt exports never copy (copy=True was requested)")
        if dl_device is not None and tuple(dl_device) != (self.dev_type, self.dev_id):
            raise BufferError(f"cannot export to device {tuple(dl_device)}")
        if self.dev_type == kDLCPU and stream is not None and stream != -1:
            raise BufferError("stream must be None for CPU arrays")
        ctx = <_ExportCtx*>malloc(sizeof(_ExportCtx))
        if ctx == NULL:
            raise MemoryError()
        ctx.shape_strides = <int64_t*>malloc(sizeof(int64_t) * (2 * n + 1))
        if ctx.shape_strides == NULL:
            free(ctx)
            raise MemoryError()
        ctx.owner = <PyObject*>self.owner
        Py_INCREF(self.owner)
        if max_version is not None and tuple(max_version)[0] >= 1:
            mv = <DLManagedTensorVersioned*>malloc(sizeof(DLManagedTensorVersioned))
            if mv == NULL:
                Py_DECREF(self.owner); free(ctx.shape_strides); free(ctx)
                raise MemoryError()
            mv.version.major = 1
            mv.version.minor = 0
            mv.manager_ctx = ctx
            mv.deleter = _versioned_deleter
            mv.flags = DLPACK_FLAG_BITMASK_READ_ONLY if self.readonly else 0
            _fill_tensor(&mv.dl_tensor, ctx.shape_strides, self.ptr, self.shape, self.strides, self.dtype,
                         self.dev_type, self.dev_id)
            return PyCapsule_New(mv, b"dltensor_versioned", _versioned_capsule_destructor)
        m = <DLManagedTensor*>malloc(sizeof(DLManagedTensor))
        if m == NULL:
            Py_DECREF(self.owner); free(ctx.shape_strides); free(ctx)
            raise MemoryError()
        m.manager_ctx = ctx
        m.deleter = _legacy_deleter
        _fill_tensor(&m.dl_tensor, ctx.shape_strides, self.ptr, self.shape, self.strides, self.dtype,
                     self.dev_type, self.dev_id)
        return PyCapsule_New(m, b"dltensor", _legacy_capsule_destructor)
