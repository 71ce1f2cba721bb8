# cython: language_level=3
"""The hot part of moe_rt._arrays' light call from torch, compiled: the fields of a DevArray (the array view
the ops' CUDA paths take), the import of a call's torch tensors as DevArrays, and a result's allocation from
torch. moe_rt._arrays holds the rest of DevArray (a Python subclass) and everything that decides."""
import math


cdef class DevArrayBase:
    """What a launch reads of a C-contiguous array in device memory: ``ptr``, ``shape``, ``dtype``, ``owner``
    (kept alive), ``device_id``, ``offset`` (elements from the owner's start), and whether the owner is a
    contiguous torch tensor of exactly this shape (``_whole``); see moe_rt._arrays.DevArray."""

    cdef public object ptr, shape, dtype, owner, device_id, offset, _cp, _whole

    def __init__(self, ptr, shape, dtype, owner, device_id, offset=0, whole=False):
        self.ptr, self.shape, self.dtype, self.owner = ptr, shape, dtype, owner
        self.device_id, self.offset, self._cp, self._whole = device_id, offset, None, whole

    @property
    def data(self):  # ``a.data.ptr`` reads like a CuPy array's
        return self

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    @property
    def nbytes(self):
        return math.prod(self.shape) * self.dtype.itemsize


cdef inline DevArrayBase _whole_view(type cls, ptr, tuple shape, dtype, owner, device_id):
    cdef DevArrayBase a = DevArrayBase.__new__(cls)
    a.ptr, a.shape, a.dtype, a.owner = ptr, shape, dtype, owner
    a.device_id, a.offset, a._cp, a._whole = device_id, 0, None, True
    return a


def torch_views(dict arrays, dict by_type, torch_dtypes, framework_of, no_autograd, type cls):
    """``arrays`` (name -> torch tensor or None) as ``(views, first name, device id)``, each tensor a ``cls``
    view over its memory, if every array is a C-contiguous CUDA torch tensor of a dtype in the table
    ``torch_dtypes()`` gives (called once a torch tensor came: a NumPy or CuPy call never imports torch), or
    None, and one at least is given; else None. Raises as moe_rt._arrays.Call does, in its order: a tensor
    that needs autograd (``no_autograd(obj, name)``), tensors on different devices."""
    cdef dict views = {}
    cdef object dtypes = None
    cdef object first = None
    cdef object device_id = 0
    for name, obj in arrays.items():
        if obj is None:
            views[name] = None
            continue
        fw = by_type.get(type(obj))
        if fw is None:
            fw = framework_of(obj)
        if fw != "torch":
            return None
        if dtypes is None:
            dtypes = torch_dtypes()
        if obj.requires_grad:
            no_autograd(obj, name)
        if not obj.is_cuda:
            return None
        dev = obj.get_device()
        if first is None:
            first, device_id = name, dev
        elif dev != device_id:
            raise ValueError(f"{name} is on cuda:{dev} but {first} is on cuda:{device_id}; "
                             "all arrays of one call must be on the same device")
        dt = dtypes.get(obj.dtype)
        if dt is None or not obj.is_contiguous():
            return None
        views[name] = _whole_view(cls, obj.data_ptr(), tuple(obj.shape), dt, obj, device_id)
    if first is None:
        return None
    return views, first, device_id


def torch_empty(empty, shape, tdtype, dtype, tdev, device_id, type cls):
    """A ``cls`` view of a new torch tensor ``empty(size=shape, dtype=tdtype, device=tdev)`` (``dtype``: its NumPy
    dtype). The size as a keyword: torch parses it about 1 us faster than a positional tuple."""
    shape = tuple(shape)
    t = empty(size=shape, dtype=tdtype, device=tdev)
    return _whole_view(cls, t.data_ptr(), shape, dtype, t, device_id)


def cupy_views(dict arrays, dict by_type, framework_of, tuple fp8_dtypes):
    """``(first name, device id)`` if every array of ``arrays`` (name -> array or None) is a CuPy one and one
    at least is given, else None. Raises as moe_rt._arrays.Call does, in its order: arrays on different
    devices, then a CuPy array of an FP8 dtype (CuPy cannot hold FP8)."""
    cdef object first = None
    cdef object device_id = 0
    cdef object fp8_name = None
    cdef object fp8_dtype = None
    for name, obj in arrays.items():
        if obj is None:
            continue
        fw = by_type.get(type(obj))
        if fw is None:
            fw = framework_of(obj)
        if fw != "cupy":
            return None
        dev = obj.device.id
        if first is None:
            first, device_id = name, dev
        elif dev != device_id:
            raise ValueError(f"{name} is on cuda:{dev} but {first} is on cuda:{device_id}; "
                             "all arrays of one call must be on the same device")
        if fp8_name is None:
            dt = obj.dtype
            if dt.itemsize == 1 and dt in fp8_dtypes:
                fp8_name, fp8_dtype = name, dt
    if first is None:
        return None
    if fp8_name is not None:
        raise TypeError(f"{fp8_name}: a CuPy {fp8_dtype.name} array; CuPy has no FP8 dtype moe_rt can use, so "
                        "FP8 on CUDA is taken from torch and JAX only (or pass the bytes as uint8 to "
                        "moe_rt.dispatch, which moves them unchanged)")
    return first, device_id
