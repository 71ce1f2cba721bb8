"""Recorded launches: the host path of a hot op cut down to a dictionary lookup, its allocations and its
driver launches, for torch CUDA tensors on torch's current stream, CuPy arrays on CuPy's current stream and
XLA's buffers inside a JAX callback.

The first call of an op with a given signature (each array's dtype, shape, device and pointer alignment;
every other argument with its type) runs the op's ordinary path once over symbolic arrays: each input and
each allocation is a DevArray at a made-up address in a window of its own, and the kernel launches are
recorded instead of made. That shows everything the call does for this signature: which arrays it
allocates (shape, dtype; result or scratch), which kernels it launches (function, grid, block, shared
memory, and the arguments, each pointer as a window and an offset) and which arrays it returns. Later calls
with the same signature replay it: allocate, put the real pointers in, launch, return the same views.

The ordinary path stays the one source of truth: validation runs there (a signature whose recording raises
is remembered as one to run the ordinary way, which then raises the same error), and so does every
decision a launch depends on. A signature whose path needs more than allocations and launches (a CuPy view,
a conversion kernel, a value read on the host) cannot be recorded and always runs the ordinary way.

``MOE_RT_FAST=0`` turns replays off (a test and benchmark switch; both ways give the same bits).
"""
from __future__ import annotations

import functools
import inspect
import math
import os
import threading

import numpy as np

from moe_rt import _arrays, _jit
from moe_rt._arrays import DevArray, Unrecordable, _Slot

_WIN_SHIFT = 36  # each symbolic array has a 64 GiB window of made-up addresses
_BASE = 0x5A5 << 40  # far above any size or count an op passes, far below 2**63
_MAX_SLOTS = 256
_CONST_TYPES = (int, np.int32, np.uint32, np.int64, np.uint64, np.float32, np.float64)
_MAX_ENTRIES = 1024  # recipes kept per op

ENABLED = os.environ.get("MOE_RT_FAST", "1") != "0"
NATIVE = True  # torch replays served by _replay.TorchHit (False: found by the wrapper below; same launches)
_lock = threading.Lock()
_SLOW = "slow"  # cache value: run the ordinary path for this signature


def _win(i: int) -> int:
    return _BASE + (i << _WIN_SHIFT)


class _Recorder:
    """What one call of an op does, gathered while it runs over symbolic arrays. ``fp8``: whether FP8 arrays
    may take part (a torch replay allocates them as torch tensors; the CuPy and XLA-buffer replays would need
    CuPy to hold FP8, which it cannot)."""

    def __init__(self, fp8=False):
        self.fp8 = fp8
        self.bases = []  # made-up address of each slot (inputs keep their real misalignment)
        self.shapes = []
        self.allocs = []  # (shape, dtype, kind) of each allocation, in order; kind: "empty" or "scratch"
        self.launches = []

    def _slot(self, base, shape):
        i = len(self.bases)
        if i >= _MAX_SLOTS:
            raise Unrecordable("too many arrays")
        self.bases.append(base)
        self.shapes.append(shape)
        return i

    def _no_fp8(self, dtype):
        if not self.fp8 and dtype in _arrays.FP8_DTYPES:
            raise Unrecordable("FP8 arrays are replayed for torch tensors only (CuPy holds no FP8)")

    def input(self, dtype, shape, misalign, device_id):
        self._no_fp8(dtype)
        i = len(self.bases)
        base = _win(i) + misalign
        self._slot(base, shape)
        return DevArray(base, shape, dtype, _Slot(i), device_id)

    def alloc(self, shape, dtype, kind, device_id):  # Call.empty / Call.scratch while recording
        shape = tuple(int(d) for d in shape)
        dtype = np.dtype(dtype)
        self._no_fp8(dtype)
        i = len(self.bases)
        self._slot(_win(i), shape)
        self.allocs.append((shape, dtype, kind))
        return DevArray(_win(i), shape, dtype, _Slot(i), device_id)

    def launch(self, fn, grid, block, args, shared_mem):  # _jit.launch_raw while recording
        tmpl, refs = [], []
        top = _win(len(self.bases))
        for pos, a in enumerate(args):
            t = type(a)
            if t is DevArray:
                if type(a.owner) is not _Slot:
                    raise Unrecordable("a launch argument is real device memory")
                a, t = a.ptr, int
            if t is int and _BASE <= a < top:
                s = (a - _BASE) >> _WIN_SHIFT
                refs.append((pos, s, a - self.bases[s]))
                tmpl.append(0)
            elif t in _CONST_TYPES:
                tmpl.append(a)
            else:
                raise Unrecordable(f"a launch argument of type {t.__name__}")
        self.launches.append((_jit.function_ptr(fn), grid, block, int(shared_mem), tuple(tmpl), tuple(refs)))

    def describe(self, out):
        """The op's result as slot references: (0, slot, shape, element offset, how) with how 0 = the slot
        as allocated, 1 = a reshape of it, 2 = a slice; (type, items) for a tuple or list; None."""
        if out is None:
            return None
        t = type(out)
        if t is DevArray:
            if type(out.owner) is not _Slot:
                raise Unrecordable("the op returns real device memory")
            s = out.owner.index
            whole = out.offset == 0 and out.size == math.prod(self.shapes[s])
            how = (0 if out.shape == self.shapes[s] else 1) if whole else 2
            return (0, s, out.shape, out.offset, how)
        if t is tuple or t is list:
            return (t, tuple(self.describe(o) for o in out))
        h = _RESULT_TYPES.get(t)
        if h is not None:
            return (1, h[1], h[0](out, self.describe))
        raise Unrecordable(f"the op returns a {t.__name__}")


# type -> (describe(obj, leaf), build(payload, get, framework)): results other than arrays and sequences
_RESULT_TYPES: dict = {}


def result_type(cls, describe, build):
    """Let recorded ops return ``cls`` objects (a dispatch plan). ``describe(obj, leaf)`` gives what a
    replay needs to make one again, with ``leaf(array)`` standing for each array in it;
    ``build(payload, get, framework)`` makes it, ``get(leaf)`` giving the replay's array for a leaf as the
    op's ordinary path would hold it for callers of ``framework`` (a DevArray for torch)."""
    _RESULT_TYPES[cls] = (describe, build)


class _Recipe:
    __slots__ = ("n_in", "allocs", "talloc", "launches", "compiled", "result")

    def __init__(self, rec: _Recorder, result, n_in: int):
        self.n_in = n_in
        self.allocs = tuple((shape, dtype, kind, math.prod(shape)) for shape, dtype, kind in rec.allocs)
        self.talloc = None  # (shape, torch dtype) per allocation, made on the first torch replay
        self.launches = tuple(rec.launches)
        self.compiled = None  # the launches packed for the driver launcher (see _run_launches)
        self.result = result


def _record(op, args, kwargs, where, metas, device_id, plan=None, fp8=False):
    """Run ``op`` over symbolic arrays in place of the real ones (``where[i]``: the position or keyword of
    array i; ``metas[i]``: its (dtype, shape, misalignment) or None) and return its recipe. ``plan``:
    (position or keyword, the plan, the metas of its arrays, a function making the same plan over
    symbolic arrays), or None. ``fp8``: whether FP8 arrays may take part (torch replays only)."""
    rec = _Recorder(fp8)
    args, kwargs = list(args), dict(kwargs)
    n_in = 0
    for w, m in zip(where, metas):
        if m is None:
            continue
        sym = rec.input(m[0], m[1], m[2], device_id)
        n_in += 1
        if type(w) is int:
            args[w] = sym
        else:
            kwargs[w] = sym
    if plan is not None:
        w, p, pmetas, symbolic = plan
        syms = [rec.input(m[0], m[1], m[2], device_id) for m in pmetas]
        n_in += len(syms)
        sp = symbolic(p, syms)
        if type(w) is int:
            args[w] = sp
        else:
            kwargs[w] = sp
    with _lock:
        _arrays.RECORDING += 1
    _arrays._rec_state.r = rec
    try:
        result = rec.describe(op(*args, **kwargs))
    finally:
        _arrays._rec_state.r = None
        with _lock:
            _arrays.RECORDING -= 1
    return _Recipe(rec, result, n_in)


# -- replay -------------------------------------------------------------------------------------------

def _run_launches(owner, ptrs, stream: int):
    """Launch each of ``owner.launches`` (function, grid, block, shared memory, arguments, pointer refs),
    every ref ``(position, key, offset)`` an argument ``ptrs[key] + offset``. With the driver launcher in
    place the launches are packed once (``owner.compiled``, a ``_launch.Launches``) and each call only
    writes the pointers; otherwise (a stand-in driver in tests) one launch call each."""
    drv = _jit._driver
    if drv is _jit._real_driver:
        c = owner.compiled
        if c is None:
            try:
                c = owner.compiled = drv.Launches(owner.launches)
            except (AttributeError, ValueError):  # an extension built before Launches, or an odd argument
                c = owner.compiled = False
        if c is not False:
            if not c.run(ptrs, stream):
                raise RuntimeError("moe_rt: the CUDA driver launcher became unavailable")
            return
    launch = drv.launch
    for fptr, grid, block, smem, tmpl, refs in owner.launches:
        a = list(tmpl)
        for pos, s, off in refs:
            a[pos] = ptrs[s] + off
        if not launch(fptr, grid, block, tuple(a), stream, smem):
            raise RuntimeError("moe_rt: the CUDA driver launcher became unavailable")


def _devarray_of(t, dev):
    """A DevArray over a torch tensor made by a replay (what the ordinary path holds for torch callers)."""
    return DevArray(t.data_ptr(), tuple(t.shape), _arrays._torch_np_dtype(t.dtype), t, dev)


_cupy = None
_ndarray = None  # cupy.ndarray once cupy is imported
_torch = None
_Tensor = None
_raw_stream = None
_cur_device = None
_tdevs: dict = {}


def _load_cupy():
    global _cupy, _ndarray
    import sys

    cupy = sys.modules.get("cupy")
    if cupy is None or not hasattr(cupy, "ndarray"):
        return False
    _cupy, _ndarray = cupy, cupy.ndarray
    return True


def _load_torch():
    """Bind torch's entry points the torch replay uses, if torch is imported (never imports it)."""
    global _torch, _Tensor, _raw_stream, _cur_device
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "_C"):
        return False
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    cur = getattr(torch._C, "_cuda_getDevice", None)
    if raw is None or cur is None:
        return False
    _torch, _Tensor, _raw_stream, _cur_device = torch, torch.Tensor, raw, cur
    return True


def _replay_dev(rec: _Recipe, arrays, ptrs, serve, stream: int, dev: int):
    """Replay for DevArrays inside a JAX callback: results go into XLA's output buffers as the ordinary
    path's Call.empty would put them (first unused buffer of the same dtype and size, in order); None when
    one has no buffer (the ordinary path then runs)."""
    avail = list(serve)
    objs = arrays
    for shape, dtype, kind, n in rec.allocs:
        if kind == "empty":
            for j, d in enumerate(avail):
                if d.dtype == dtype and d.size == n:
                    break
            else:
                return None
            d = avail.pop(j)
            if d.ptr & 15:
                return None
            o = d if d.shape == shape else d.reshape(shape)
            objs.append(o)
            ptrs.append(o.ptr)
        else:
            import cupy

            c = cupy.empty(shape, dtype)
            objs.append(c)
            ptrs.append(c.data.ptr)
    serve[:] = avail  # the buffers taken, as Call.empty takes them
    _run_launches(rec, ptrs, stream)
    return _result(rec.result, objs, 1, dev)


def _replay_cupy(rec: _Recipe, arrays, ptrs, dev: int):
    cupy = _cupy
    objs = arrays
    for shape, dtype, _, _ in rec.allocs:
        c = cupy.empty(shape, dtype)
        objs.append(c)
        ptrs.append(c.data.ptr)
    _run_launches(rec, ptrs, cupy.cuda.get_current_stream().ptr)
    return _result(rec.result, objs, 2, dev)


# -- the wrapper --------------------------------------------------------------------------------------

def recorded(*array_params, variant=None, plan=None):
    """Give the op a replay path for the signatures it has recorded. ``array_params``: the names of its
    array parameters (positional or keyword-only); ``variant``: a callable whose value joins the signature
    (module settings the op's launches depend on); ``plan``: None or ``(name, parts, symbolic)`` for a
    parameter holding a dispatch plan: ``parts(plan)`` gives None (no replay) or ``(signature, arrays,
    metas, pointers, device id)`` of the plan, ``symbolic(plan, arrays)`` the same plan over other arrays."""

    def deco(op):
        params = list(inspect.signature(op).parameters.values())
        index = {p.name: i for i, p in enumerate(params)}

        def place(name):
            p = params[index[name]]
            return (index[name] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None), name

        where = tuple(place(name) for name in array_params)  # per array parameter: (position or None, name)
        plan_at = None if plan is None else place(plan[0])
        parts, symbolic = (None, None) if plan is None else plan[1:]
        cache: dict = {}
        try:
            from moe_rt import _replay
        except ImportError:  # pragma: no cover - the extension is built with the package: no replays without it
            op.ordinary, op.recipes, op.torch_hit = op, cache, None
            return op
        gather, signature = _replay.gather, _replay.signature
        # the compiled replay for torch tensors, over the same cache and the same signatures
        hit, miss = _replay.TorchHit(where, plan_at, parts, variant, cache), _replay.MISS

        @functools.wraps(op)
        def fast(*args, **kwargs):
            r = hit(args, kwargs)
            if r is not miss:
                return r
            if not ENABLED or not _jit._use_driver or kwargs.get("stream") is not None or (
                    _arrays.RECORDING and _arrays.recorder() is not None):
                return op(*args, **kwargs)
            n = len(args)
            arrays, places = gather(where, args, kwargs)
            a0 = arrays[0]
            t0 = type(a0)
            if t0 is DevArray:
                serve = getattr(_arrays._serving, "outs", None)
                if serve is None:
                    return op(*args, **kwargs)
                mode = 1
            elif t0 is _Tensor or (_Tensor is None and t0.__module__.startswith("torch") and _load_torch()
                                   and t0 is _Tensor):
                mode = 0
            elif t0 is _ndarray or (_ndarray is None and t0.__module__.startswith("cupy") and _load_cupy()
                                    and t0 is _ndarray):
                mode = 2
            else:
                return op(*args, **kwargs)
            metas, ptrs, objs = [], [], []
            dev = None
            for a in arrays:
                if a is None:
                    metas.append(None)
                    continue
                if mode == 0:
                    if (type(a) is not _Tensor or not a.is_cuda or not a.is_contiguous()
                            or (a.requires_grad and _torch.is_grad_enabled())):
                        return op(*args, **kwargs)  # which refuses a tensor needing autograd
                    p = a.data_ptr()
                    d = a.get_device()
                elif mode == 2:
                    if type(a) is not _ndarray or not a.flags.c_contiguous:
                        return op(*args, **kwargs)
                    p = a.data.ptr
                    d = a.device.id
                else:
                    if type(a) is not DevArray:
                        return op(*args, **kwargs)
                    p, d = a.ptr, a.device_id
                if dev is None:
                    dev = d
                elif d != dev:
                    return op(*args, **kwargs)  # the ordinary path names the mismatch
                metas.append((a.dtype, a.shape, p & 15))
                ptrs.append(p)
                objs.append(a)
            pkey = pinfo = pl_place = None
            if plan_at is not None:
                pos, name = plan_at
                if pos is not None and pos < n:
                    pl_obj, pl_place = args[pos], pos
                else:
                    pl_obj, pl_place = kwargs.get(name), name
                pp = parts(pl_obj)
                if pp is None or (dev is not None and pp[4] != dev):
                    return op(*args, **kwargs)
                pkey, parrays, pmetas, pptrs, dev = pp
                objs.extend(parrays)
                ptrs.extend(pptrs)
                pinfo = (pl_place, pl_obj, pmetas, symbolic)
            if (mode == 0 and _cur_device() != dev) or (mode == 2 and _cupy.cuda.runtime.getDevice() != dev):
                return op(*args, **kwargs)
            try:
                key = signature(mode, dev, metas, pkey, args, kwargs, places, pl_place, variant)
                rec = cache.get(key)
            except TypeError:  # an unhashable argument: the ordinary path judges it
                return op(*args, **kwargs)
            if rec is None:
                try:
                    np_metas = []
                    for m in metas:
                        if m is None:
                            np_metas.append(None)
                            continue
                        dt = _arrays._torch_np_dtype(m[0]) if mode == 0 else m[0]
                        if dt is None:
                            raise Unrecordable("a dtype moe_rt does not handle")
                        np_metas.append((dt, tuple(m[1]), m[2]))
                    rec = _record(op, args, kwargs, places, np_metas, dev, pinfo, fp8=mode == 0)
                except _arrays.NotYet:  # a quick kernel this time: run it the ordinary way, record a later call
                    return op(*args, **kwargs)
                except Exception:  # noqa: BLE001 - unrecordable or bad input: the ordinary path runs (and raises)
                    rec = _SLOW
                if len(cache) >= _MAX_ENTRIES:
                    cache.clear()
                cache[key] = rec
            if rec is _SLOW:
                return op(*args, **kwargs)
            if mode == 0:
                return _replay_torch(rec, objs, ptrs, dev)
            if mode == 2:
                return _replay_cupy(rec, objs, ptrs, dev)
            stream = getattr(_arrays._serving, "stream", None)
            out = None if stream is None else _replay_dev(rec, objs, ptrs, serve, stream, dev)
            return op(*args, **kwargs) if out is None else out

        fast.ordinary = op  # the path without replays
        fast.recipes = cache
        fast.torch_hit = hit  # the compiled torch replay
        return fast

    return deco


try:  # compiled (moe_rt/_replay.pyx): the result builder of every replay, and the torch replay
    from moe_rt._replay import replay_torch as _replay_torch  # noqa: E402
    from moe_rt._replay import result as _result  # noqa: E402
except ImportError:  # pragma: no cover - built with the package; without it recorded() replays nothing
    _result = _replay_torch = None
