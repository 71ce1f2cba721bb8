# cython: boundscheck=False, wraparound=False
"""The replay of a recorded op (``moe_rt._fast``) for torch CUDA tensors, compiled.

A recorded op called on torch tensors whose signature has a recipe spends its host time in the Python of
the replay: gathering the arrays, building the signature, allocating the outputs, writing the pointers,
building the result. :class:`TorchHit` does that same work as compiled code, for that case alone: the
arrays torch CUDA tensors, the signature one the op has recorded. Every other call (another framework, a
signature not recorded yet or one that runs the ordinary way, anything unusual) gets :data:`MISS` back,
and the Python path of ``moe_rt._fast`` runs as before. Both gather the arrays with :func:`gather` and key
the one cache with :func:`signature`, so each serves the recipes the other recorded.
"""
import math

from moe_rt import _arrays, _fast, _jit

MISS = object()  # "not served here": the caller takes the Python path


cdef int _gather(tuple where, tuple args, dict kwargs, list arrays, list places) except -1:
    cdef Py_ssize_t n = len(args)
    for pos, name in where:
        if pos is not None and pos < n:
            arrays.append(args[pos])
            places.append(pos)
        else:
            arrays.append(kwargs.get(name))
            places.append(name)
    return 0


def gather(tuple where, tuple args, dict kwargs):
    """A recorded op's array arguments and where each was given: ``(arrays, places)``, ``places[i]`` the
    position of array i in ``args`` or, when it was not passed by position, its name (``where``: the
    op's array parameters as (position or None, name))."""
    cdef list arrays = []
    cdef list places = []
    _gather(where, args, kwargs, arrays, places)
    return arrays, places


cdef tuple _signature(int mode, dev, list metas, pkey, tuple args, dict kwargs, list places, plan_place, variant):
    cdef list other = list(args)
    cdef dict kw = dict(kwargs)
    for pl in places:
        if type(pl) is int:
            other[pl] = None
        else:
            kw[pl] = None
    if plan_place is not None:
        if type(plan_place) is int:
            other[plan_place] = None
        else:
            kw[plan_place] = None
    vals = tuple(kw.values())
    return (mode, dev, tuple(metas), pkey, tuple(other), tuple([type(o) for o in other]), tuple(kw.items()),
            tuple([type(v) for v in vals]), variant() if variant is not None else None)


def signature(int mode, dev, list metas, pkey, tuple args, dict kwargs, list places, plan_place, variant):
    """The key a recorded op's recipes are cached under: the replay mode (0 torch, 1 XLA buffers, 2 CuPy),
    the device, each array's (dtype, shape, pointer misalignment) or None, the plan's key, every other
    argument with its type (the arrays and the plan as None, at ``places`` and ``plan_place``), and the
    value of ``variant()``. Raises TypeError for an unhashable argument only when the key is hashed."""
    return _signature(mode, dev, metas, pkey, args, kwargs, places, plan_place, variant)


cdef class TorchHit:
    """The replay of one recorded op for torch tensors; see the module docstring. Built by
    ``_fast.recorded`` with the op's array parameters (``where``: (position or None, name) each), its plan
    parameter (``plan_at``, ``parts``) and ``variant``, over the op's recipe ``cache``."""

    cdef tuple where
    cdef object plan_at
    cdef object parts
    cdef object variant
    cdef dict cache

    def __init__(self, tuple where, plan_at, parts, variant, dict cache):
        self.where, self.plan_at, self.parts, self.variant, self.cache = where, plan_at, parts, variant, cache

    def __call__(self, tuple args, dict kwargs):
        cdef Py_ssize_t n = len(args)
        cdef list arrays = []
        cdef list places = []
        cdef list metas = []
        cdef list ptrs = []
        cdef list objs = []
        cdef object a, p, d, dev = None, pos, name, rec, pkey = None, pl_place = None
        Tensor = _fast._Tensor
        pos, name = self.where[0]
        a = args[pos] if pos is not None and pos < n else kwargs.get(name)
        if Tensor is None or type(a) is not Tensor:  # other frameworks: straight to the Python path
            return MISS
        if not _fast.NATIVE or not _fast.ENABLED or not _jit._use_driver or _arrays.RECORDING:
            return MISS
        if kwargs and kwargs.get("stream") is not None:
            return MISS
        _gather(self.where, args, kwargs, arrays, places)
        for a in arrays:
            if a is None:
                metas.append(None)
                continue
            if type(a) is not Tensor or not a.is_cuda or not a.is_contiguous():
                return MISS
            if a.requires_grad and _fast._torch.is_grad_enabled():
                return MISS  # the Python path refuses it (the core ops record no autograd)
            p = a.data_ptr()
            d = a.get_device()
            if dev is None:
                dev = d
            elif d != dev:
                return MISS
            metas.append((a.dtype, a.shape, p & 15))
            ptrs.append(p)
            objs.append(a)
        if self.plan_at is not None:
            pos, name = self.plan_at
            if pos is not None and pos < n:
                pl_obj, pl_place = args[pos], pos
            else:
                pl_obj, pl_place = kwargs.get(name), name
            pp = self.parts(pl_obj)
            if pp is None or (dev is not None and pp[4] != dev):
                return MISS
            pkey = pp[0]
            objs.extend(pp[1])
            ptrs.extend(pp[3])
            dev = pp[4]
        if _fast._cur_device() != dev:
            return MISS
        try:
            rec = self.cache.get(_signature(0, dev, metas, pkey, args, kwargs, places, pl_place, self.variant))
        except TypeError:
            return MISS
        if rec is None or rec is _fast._SLOW:
            return MISS
        return replay_torch(rec, objs, ptrs, dev)


def replay_torch(rec, list objs, list ptrs, dev):
    """A recipe's replay for torch tensors (``objs``, ``ptrs``: the inputs' tensors and pointers, the
    allocations appended): allocate the recipe's arrays with torch, launch, build the result."""
    talloc = rec.talloc
    if talloc is None:
        talloc = rec.talloc = tuple([(a[0], _arrays._torch_dtype_of(a[1])) for a in rec.allocs])
    tdev = _fast._tdevs.get(dev)
    if tdev is None:
        tdev = _fast._tdevs[dev] = _fast._torch.device("cuda", dev)
    empty = _fast._torch.empty
    for shape, tdt in talloc:
        t = empty(shape, dtype=tdt, device=tdev)
        objs.append(t)
        ptrs.append(t.data_ptr())
    stream = _fast._raw_stream(dev)
    c = rec.compiled
    if c is not None and c is not False and _jit._driver is _jit._real_driver:
        if not c.run(ptrs, stream):
            raise RuntimeError("moe_rt: the CUDA driver launcher became unavailable")
    else:
        _fast._run_launches(rec, ptrs, stream)
    return result(rec.result, objs, 0, dev)


_FRAMEWORKS = ("torch", "devarray", "cupy")  # by replay mode


def result(d, list objs, int mode, dev):
    """A recorded op's result from its description (``_fast._Recorder.describe``) over a replay's arrays:
    torch tensors (``mode`` 0), DevArrays (1) or CuPy arrays (2), each reshaped into a view where the
    description says so."""
    if d is None:
        return None
    tag = d[0]
    if tag == 0:
        o = objs[d[1]]
        how = d[4]
        if how == 0:
            return o
        if how == 1:
            return o.reshape(d[2])
        return o.reshape(-1)[d[3]:d[3] + math.prod(d[2])].reshape(d[2])
    if tag == 1:
        if mode == 0:
            get = lambda leaf: _fast._devarray_of(result(leaf, objs, mode, dev), dev)
        else:
            get = lambda leaf: result(leaf, objs, mode, dev)
        return d[1](d[2], get, _FRAMEWORKS[mode])
    return tag([result(x, objs, mode, dev) for x in d[1]])
