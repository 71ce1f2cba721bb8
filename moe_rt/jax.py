"""JAX adapters: moe_rt ops as ``jax.custom_vjp`` functions usable inside ``jax.jit`` and under
``jax.grad``.

On the GPU, the single-GPU ops (the router top-k in every routing form, the Quantile Balancing top-k,
``scores_for_aux_loss``, ``aux_loss``, ``make_plan``, ``dispatch``, ``combine``, ``sort_chunks``, the FP8
casts; forward and backward) lower to XLA FFI custom calls: handlers in compiled C (csrc/xla_ffi.c, ``libmoe_rt_xla.so``) that
run the C core's ops on XLA's stream, with no Python at run time, and that XLA may capture in command
buffers (CUDA graphs). Their static facts (topk, score function, groups, scaling, align size, ...) are the
calls' attributes; the kernels they launch are compiled into the kernel cache folder and loaded when the op
is lowered (:mod:`moe_rt._xla`). So do the low-latency EP ops (``ll_dispatch``, ``ll_combine`` and their
VJPs; :mod:`moe_rt._jax_ep`), and the capacity-mode EP ops (``ep_prepare``, ``ep_dispatch``, ``ep_combine``
and their VJPs) of a group on the direct transport (:func:`ep_path` says "ffi"). The EP ops of other groups
(NCCL or mixed transport; :func:`ep_path` "buffer_callback"), FP8 EP dispatches, and every op on the CPU (the
NumPy reference) lower to ``jax.experimental.buffer_callback``: inside a jitted computation
the callback receives XLA's buffers and stream, views them in place (their ``__cuda_array_interface__``; no
copy), runs moe_rt's kernels on that stream (or the NumPy reference for CPU buffers) and puts the results
into XLA's output buffers (see ``_run``). Under ``vmap`` each op runs once per batch element, in order (a
loop, not a batched kernel): every op is already batched over tokens, so folding a batch of token sets into
the token dimension is the fast path where the math allows it.

Dispatch plans travel as :class:`JaxPlan`, a pytree of int32 arrays with the static sizes as metadata, so a
plan can be passed through ``jit``, ``grad``, ``checkpoint`` and ``custom_vjp`` residuals.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from moe_rt import _arrays, _errors, _xla
from moe_rt import fp8 as _fp8
from moe_rt import permutation as _perm
from moe_rt import router as _rt

__all__ = ["JaxPlan", "make_plan", "dispatch", "combine", "topk_with_score", "topk_with_score_qb",
           "scores_for_aux_loss", "aux_loss", "sort_chunks", "quantize_fp8", "dequantize_fp8", "JaxEpHandle",
           "ep_prepare", "ep_dispatch", "ep_combine", "ep_path", "reset_ep_order"]

_PLAN_ARRAYS = ("dst_row", "src_slot", "seg_start", "counts", "tokens_per_expert")


def _array(a, name, *, optional=False):
    """An array argument: a JAX array (or tracer) as it is, a NumPy array as a JAX one; None where the op takes
    none. Anything else (a list, a scalar, another framework's tensor, None where an array is required) is a
    TypeError naming the argument, as the core ops and moe_rt.torch refuse it."""
    if isinstance(a, jax.Array):  # tracers too
        return a
    if a is None and optional:
        return None
    if isinstance(a, (np.ndarray, np.generic)):
        return jnp.asarray(a)
    raise TypeError(f"{name}: expected a JAX array, got {type(a).__name__}")


def _host_values(a):
    """``a``'s values as a NumPy array when they are in host memory already (a concrete array on the CPU), else
    None (a tracer, or an array on a GPU: reading it would sync). The CPU backend checks values at once, as the
    core ops do on the CPU."""
    if isinstance(a, jax.core.Tracer) or not isinstance(a, jax.Array):
        return None
    try:
        if any(d.platform != "cpu" for d in a.devices()):
            return None
    except (AttributeError, RuntimeError):
        return None
    return np.asarray(a)


def _run(fn, out_specs, *inputs, collective=False):
    """Run ``fn(*views)`` (views: CuPy or NumPy arrays over XLA's buffers; None inputs stay None) inside a
    buffer_callback and put its results into XLA's outputs described by ``out_specs``.

    On the GPU, a CuPy allocation whose byte size equals that of exactly one output is served from that
    output's buffer (once); a result that landed there needs no copy, anything else is copied in
    afterwards, on XLA's stream as well. moe_rt's ops keep no device arrays between calls, so no buffer
    outlives the callback. A result for an output of size zero is not read (it may be None)."""
    present = [i for i, a in enumerate(inputs) if a is not None]
    n_in = len(inputs)
    # FP8 never crosses the callback boundary as FP8 (XLA's GPU buffers of an FP8 type offer no
    # __cuda_array_interface__): its bytes go in and come out as uint8 (a bitcast, free in XLA), and the
    # views inside the callback carry the FP8 dtype again (see _as_fp8)
    fp8_in = {j: np.dtype(inputs[j].dtype) for j in present if np.dtype(inputs[j].dtype) in _arrays.FP8_DTYPES}
    out_specs = list(out_specs)
    fp8_out = {k: np.dtype(s.dtype) for k, s in enumerate(out_specs) if np.dtype(s.dtype) in _arrays.FP8_DTYPES}
    for k in fp8_out:
        out_specs[k] = _spec(out_specs[k].shape, np.uint8)

    def callback(ctx, outs, *ins):
        sptr = _xla_stream(ctx, ins, outs)
        on = _gpu_stream(sptr, ins[0] if ins else outs[0]) if sptr else None
        if on is None:
            _run_generic(fn, n_in, present, outs, ins, sptr, fp8_in, fp8_out)
            return
        stream, device, dev_id = on
        views = [None] * n_in
        for j, b in zip(present, ins):
            views[j] = _view(b, dev_id) if j not in fp8_in else _as_fp8(_dev_view(b, dev_id), fp8_in[j])
        dsts = [_view(o, dev_id) if k not in fp8_out else _as_fp8(_dev_view(o, dev_id), fp8_out[k])
                for k, o in enumerate(outs)]
        # the copies into XLA's outputs run on XLA's stream too: outside it they would go to CuPy's default
        # (legacy) stream, which XLA's non-blocking stream does not wait for, nor it for them (the copy could
        # read its result before the op's kernels wrote it, or land before an earlier write of that buffer)
        with device, stream:
            with _into(dsts):
                results = fn(*views)
            _write(dsts, results, True)
    # vmap runs the callback once per batch element (every op is already batched over tokens; a batch of
    # plans or routings is a loop), in order, which also keeps EP collectives matched across ranks.
    args = [inputs[i] if i not in fp8_in else jax.lax.bitcast_convert_type(inputs[i], jnp.uint8) for i in present]
    results = buffer_callback(callback, out_specs, vmap_method="sequential", has_side_effect=collective)(*args)
    if not fp8_out:
        return results
    return [r if k not in fp8_out else jax.lax.bitcast_convert_type(r, fp8_out[k]) for k, r in enumerate(results)]


def _xla_stream(ctx, ins, outs):
    """XLA's compute stream of a buffer_callback (``ctx.stream``), or None for CPU buffers, which have none.
    Whether the buffers are CPU buffers is read from their DLPack device, not from the failure: on GPU buffers a
    failure to read the stream raises, since running the op on CuPy's current stream instead would leave it
    unordered with XLA's work."""
    try:
        return ctx.stream
    except Exception:
        if any(_arrays._device_of(b, "buffer")[0] != "cpu" for bufs in (ins, outs) for b in bufs):
            raise
        return None


def _as_fp8(v, dtype):
    """``v``, a view of a uint8 XLA buffer holding FP8 values of ``dtype``, as that FP8 array (the same
    bytes): a DevArray of ``dtype`` on the GPU (CuPy holds no FP8), a NumPy view on the CPU."""
    if type(v) is _arrays.DevArray:
        return _arrays.DevArray(v.ptr, v.shape, dtype, v.owner, v.device_id, v.offset)
    if isinstance(v, np.ndarray):
        return v.view(dtype)
    return _arrays.fp8_array(v, dtype)  # a CuPy uint8 array (C-contiguous: no copy)


# XLA stream (cudaStream_t) -> (CuPy stream, CuPy device, device id): a stream belongs to one device.
_streams: dict = {}


def _gpu_stream(sptr, buf):
    ent = _streams.get(sptr)
    if ent is None:
        kind, dev_id = _arrays._device_of(buf, "buffer")
        if kind != "cuda":
            return None
        import cupy

        ent = _streams[sptr] = (_arrays.as_cupy_stream(int(sptr), dev_id), cupy.cuda.Device(dev_id), dev_id)
    return ent


_DTYPES: dict = {}


def _view(buf, dev_id):
    """A CuPy array over an XLA GPU buffer, no copy (FP8 buffers come as uint8: see _run)."""
    return _arrays.cupy_of(_dev_view(buf, dev_id))


def _dev_view(buf, dev_id):
    """A DevArray over an XLA GPU buffer (dense row-major, as XLA hands them to callbacks), no copy."""
    cai = buf.__cuda_array_interface__
    if cai.get("strides") is not None:
        return _arrays._xla_view(buf, dev_id)
    dt = _DTYPES.get(buf.dtype)
    if dt is None:
        dt = _DTYPES[buf.dtype] = np.dtype(buf.dtype)
    return _arrays.DevArray(cai["data"][0], tuple(cai["shape"]), dt, buf, dev_id)


def _run_generic(fn, n_in, present, outs, ins, sptr, fp8_in, fp8_out):
    """The callback body through :class:`moe_rt._arrays.Call` (CPU buffers, and GPU buffers seen first);
    ``fp8_in`` / ``fp8_out``: the FP8 dtype of each input / output passed as its uint8 bytes."""
    arrays = {f"i{j}": a for j, a in zip(present, ins)}
    arrays.update({f"o{j}": o for j, o in enumerate(outs)})
    call = _arrays.Call(arrays, stream=sptr if sptr else None, xla_buffers=True)
    with call:
        views = [None if j not in present else call[f"i{j}"] if j not in fp8_in else
                 _as_fp8(call[f"i{j}"], fp8_in[j]) for j in range(n_in)]
        dsts = [call[f"o{k}"] if k not in fp8_out else _as_fp8(call[f"o{k}"], fp8_out[k]) for k in range(len(outs))]
        if call.backend == "cuda":
            with _into(dsts):
                results = fn(*views)
        else:
            results = fn(*views)
        _write(dsts, results, call.backend == "cuda")


def _write(dsts, results, on_gpu: bool) -> None:
    """Copy each result into its XLA output unless it was computed there already (outputs of size zero
    are left alone)."""
    for dst, r in zip(dsts, results):
        if dst.size and not (on_gpu and _in_place(r, dst)):
            # (FP8 on the GPU: DevArrays, whose CuPy views are their bytes as uint8)
            d, r = _arrays.cupy_of(dst), _arrays.cupy_of(r)
            d[...] = r.reshape(d.shape)


def _in_place(r, dst):
    return (r.data.ptr == dst.data.ptr and r.dtype == dst.dtype and r.size == dst.size
            and r.flags.c_contiguous)


def _into(dsts):
    """A CuPy allocator context serving each output buffer of ``dsts`` with a unique byte size once."""
    import cupy

    sizes = [int(d.nbytes) for d in dsts]
    offer = {n: _arrays.cupy_of(d).data for d, n in zip(dsts, sizes) if n > 0 and sizes.count(n) == 1}
    pool = cupy.get_default_memory_pool()

    def alloc(nbytes):
        ptr = offer.pop(int(nbytes), None)
        return ptr if ptr is not None else pool.malloc(nbytes)

    return cupy.cuda.using_allocator(alloc)


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), jnp.dtype(dtype))


# -- XLA FFI (CUDA) ------------------------------------------------------------------------------------
#
# The ops moved to XLA FFI (see the module's docstring) lower, for CUDA, to custom calls whose handlers
# (csrc/xla_ffi.c) run the C core on XLA's stream: no Python at run time, capturable in command buffers. Their static facts are the calls' attributes; the
# kernels they launch are made ready when they are traced (moe_rt._xla.prepare). For other platforms (the
# CPU: the NumPy reference) they lower to the callback path above, chosen per platform by the primitive
# below. Under vmap a custom call runs once per batch element, in order, as the
# callbacks do.

def _ffi(op, out_specs, *args, collective=False, **attrs):
    """The custom call of ``op``; a ``collective`` one (an EP op: every rank must run it) is side-effecting,
    so XLA never removes it (as it would a call whose results go unused or hold no element, on a rank with no
    tokens); its place among the other collectives is fixed by :func:`_on_platform` (``ordered``)."""
    return jax.ffi.ffi_call(_xla.target(op), out_specs, vmap_method="sequential",
                            has_side_effect=collective)(*args, **attrs)


def _dtype_code(dt):
    return _xla.DTYPE_CODES[jnp.dtype(dt).name]


# One primitive whose lowering is per platform: ``cuda(*args)`` lowered for CUDA, ``default(*args)`` for
# the others, both traced only when lowered (so the kernels are prepared only when the op is lowered for
# CUDA). (jax.lax.platform_dependent is no use here: its cond is resolved to the default branch when some
# outputs of a custom_vjp function go unused.)
#
# EP ops are collectives: every rank must run the same ones in the same order, or the ranks exchange the
# wrong buffers (or wait for each other until the group's timeout). Data dependencies do not fix that order:
# a VJP may not depend on its forward op's result (a loss linear in it), and on a rank with no tokens the
# arrays between two layers hold no element, so XLA drops those edges; ranks whose programs differ in shape
# may then be scheduled differently. So an EP op binds the primitive with ``ordered=True``: it carries an
# ordered effect (JAX threads one token through every such op of a program, and across the programs a
# process runs, in program order), and its lowering ties that token to the op's operands before and to its
# results after (optimization barriers), so no EP op can move past another. Its custom call or callback is
# also side-effecting (see _ffi, _run): XLA never removes it.
from jax._src import effects as _effects  # noqa: E402 - ordered effects have no public registration API
from jax._src.lib.mlir.dialects import hlo as _hlo  # noqa: E402


class _CollectiveEffect(jax.extend.core.Effect):
    def __str__(self):
        return "moe_rt.EpCollective"


_COLLECTIVE = _CollectiveEffect()
for _kind in (_effects.lowerable_effects, _effects.ordered_effects, _effects.control_flow_allowed_effects,
              _effects.custom_derivatives_allowed_effects, _effects.remat_allowed_effects):
    _kind.add_type(_CollectiveEffect)


def reset_ep_order() -> None:
    """Start a fresh token for the EP ops' ordered effect on the calling thread.

    When a program holding EP ops fails (a peer timed out, a group was closed), JAX keeps the token the
    failed program returned, and every later program with EP ops fails with that same error before it runs
    (JAX's rule for ordered effects). After handling the error (new groups made where the old ones are
    broken), call this so that later programs run. It drops only the EP effect's token, and the per-device
    runtime tokens of programs that failed (which ``jax.effects_barrier()`` and the interpreter's exit would
    raise again)."""
    from jax._src import dispatch  # the runtime token set has no public API

    tokens = dispatch.runtime_tokens
    tokens.current_tokens.pop(_COLLECTIVE, None)
    for device, token in list(tokens.output_runtime_tokens.items()):
        try:
            token.block_until_ready()
        except Exception:  # noqa: BLE001 - the failed program's error, already raised to the caller
            tokens.output_runtime_tokens.pop(device, None)


_per_platform_p = Primitive("moe_rt_per_platform")
_per_platform_p.multiple_results = True
_per_platform_p.def_effectful_abstract_eval(
    lambda *avals, cuda, default, out_avals, ordered: (list(out_avals), {_COLLECTIVE} if ordered else set()))
# outside jit: compiled and run for the arrays' device, as any primitive
_per_platform_p.def_impl(lambda *args, **params: jax.jit(partial(_per_platform_p.bind, **params))(*args))


def _ir_values(v):
    return v if isinstance(v, (list, tuple)) else (v,)


def _lowering(which):
    def rule(ctx, *args, cuda, default, out_avals, ordered):
        lower = mlir.lower_fun(cuda if which == "cuda" else default, multiple_results=True)
        if not ordered:
            return lower(ctx, *args)
        # (every operand and result is an array: one IR value each)
        token, *args = _hlo.OptimizationBarrierOp([ctx.tokens_in.get(_COLLECTIVE), *args]).results
        outs = lower(ctx.replace(tokens_in=mlir.TokenSet(), tokens_out=None), *args)
        token, *outs = _hlo.OptimizationBarrierOp([token, *(v for o in outs for v in _ir_values(o))]).results
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({_COLLECTIVE: token})))
        return outs
    return rule


mlir.register_lowering(_per_platform_p, _lowering("default"))
mlir.register_lowering(_per_platform_p, _lowering("cuda"), platform="cuda")


def _per_platform_batch(args, dims, **params):
    # vmap: once per batch element, in order (as the callbacks and jax.ffi's "sequential" method do)
    mapped = [d is not None for d in dims]
    moved = [jnp.moveaxis(a, d, 0) for a, d in zip(args, dims) if d is not None]

    def one(xs):
        it = iter(xs)
        return _per_platform_p.bind(*[next(it) if m else a for a, m in zip(args, mapped)], **params)

    outs = jax.lax.map(one, moved)
    return outs, [0] * len(outs)


batching.primitive_batchers[_per_platform_p] = _per_platform_batch


def _on_platform(args, cuda, default, out_specs, *, ordered=False):
    """``cuda(*args)`` when lowered for CUDA, ``default(*args)`` otherwise (``args`` may hold None; ``cuda``
    None: ``default`` everywhere); both return arrays matching ``out_specs``. ``ordered``: an EP collective,
    kept in program order among the others (see _COLLECTIVE)."""
    if cuda is None:
        cuda = default
    present = [i for i, a in enumerate(args) if a is not None]

    def full(flat):
        out = [None] * len(args)
        for i, a in zip(present, flat):
            out[i] = a
        return out

    avals = tuple(jax.core.ShapedArray(tuple(s.shape), jnp.dtype(s.dtype)) for s in out_specs)
    return _per_platform_p.bind(*[args[i] for i in present], cuda=lambda *f: list(cuda(*full(f))),
                                default=lambda *f: list(default(*full(f))), out_avals=avals, ordered=ordered)


# -- plans ---------------------------------------------------------------------------------------------

@jax.tree_util.register_pytree_node_class
class JaxPlan:
    """A dispatch plan (see :class:`moe_rt.permutation.Plan`) as JAX arrays: ``dst_row [T,K]``,
    ``src_slot [N]``, ``seg_start [E+1]``, ``counts [E]``, ``tokens_per_expert [E]`` (int32); static
    ``num_experts``, ``num_rows``, ``align_size``, ``num_out_tokens`` (-1 = none)."""

    def __init__(self, arrays, num_experts, num_rows, align_size, num_out_tokens):
        self.arrays = tuple(arrays)
        self.num_experts, self.num_rows = int(num_experts), int(num_rows)
        self.align_size, self.num_out_tokens = int(align_size), int(num_out_tokens)

    def __getattr__(self, name):
        if name in _PLAN_ARRAYS:
            return self.arrays[_PLAN_ARRAYS.index(name)]
        raise AttributeError(name)

    @property
    def static(self):
        return (self.num_experts, self.num_rows, self.align_size, self.num_out_tokens)

    def tree_flatten(self):
        return self.arrays, self.static

    @classmethod
    def tree_unflatten(cls, static, arrays):
        return cls(arrays, *static)


def _as_plan(views, static):
    """A moe_rt Plan over the five plan arrays (NumPy: the plan ops' callbacks run on the CPU only; shapes
    checked by :func:`_check_plan` when the op was traced)."""
    _, num_rows, align_size, num_out_tokens = static
    return _perm.Plan.from_arrays(*views, num_rows=num_rows, align_size=align_size, num_out_tokens=num_out_tokens)


def _check_plan(plan):
    """Trace-time check of a JaxPlan's arrays against its static sizes (shapes and dtypes are static)."""
    if not isinstance(plan, JaxPlan):
        raise TypeError(f"plan: expected a JaxPlan from moe_rt.jax.make_plan, got {type(plan).__name__}")
    E, N = plan.num_experts, plan.num_rows
    if len(plan.arrays) != len(_PLAN_ARRAYS) or any(jnp.dtype(a.dtype) != jnp.int32 for a in plan.arrays):
        raise ValueError("plan: a JaxPlan holds five int32 arrays")
    want = {"src_slot": (N,), "seg_start": (E + 1,), "counts": (E,), "tokens_per_expert": (E,)}
    if len(plan.arrays[0].shape) != 2:
        raise ValueError(f"plan: dst_row must be 2-D, got shape {tuple(plan.arrays[0].shape)}")
    for name, shape in want.items():
        got = tuple(plan.arrays[_PLAN_ARRAYS.index(name)].shape)
        if got != shape:
            raise ValueError(f"plan: {name} must have shape {shape}, got {got}")


def make_plan(routing, num_experts: int, *, align_size: int = 1, num_out_tokens: int | None = None,
              map_type: str | None = None) -> JaxPlan:
    """:func:`moe_rt.permutation.make_plan` for JAX (jit-compatible): ``routing`` is ``topk_idx [T,K]``
    int32 (-1 = none) or ``routing_map [T,E]`` bool (or integer 0/1 with ``map_type="mask"``);
    ``map_type`` as in the core op (an integer ``[T, num_experts]`` array needs it). Shapes, dtypes and
    settings are checked when traced."""
    routing = jax.lax.stop_gradient(_array(routing, "routing"))  # discrete: no derivative flows through a plan
    E, align_size, num_out_tokens = _perm.check_plan_settings(num_experts, align_size, num_out_tokens, map_type)
    T, K, is_map, N = _perm.check_routing(routing, E, align_size, num_out_tokens, map_type)
    if not is_map:
        ids = _host_values(routing)
        if ids is not None:
            _errors.check_ids(ids, E, "routing")
    if is_map and routing.dtype != jnp.bool_:
        routing = routing != 0  # an integer 0/1 map (map_type="mask"), made bool here (traceable)
    core_map_type = None if is_map else "index"
    specs = [_spec((T, K), np.int32), _spec((N,), np.int32), _spec((E + 1,), np.int32),
             _spec((E,), np.int32), _spec((E,), np.int32)]

    num_out = -1 if num_out_tokens is None else int(num_out_tokens)

    def fn(r):
        p = _perm.make_plan(r, E, align_size=align_size, num_out_tokens=num_out_tokens, map_type=core_map_type)
        return [getattr(p, k) for k in _PLAN_ARRAYS]

    def on_cuda(r):
        rdt = _dtype_code(r.dtype)
        _xla.prepare("make_plan", routing_dtype=rdt, T=T, K=K, E=E, align_size=align_size, num_out_tokens=num_out)
        ws = _spec((_xla.make_plan_workspace_bytes(T, K, E),), np.uint8)
        return _ffi("make_plan", specs + [ws], r, num_experts=np.int32(E), align_size=np.int32(align_size),
                    num_out_tokens=np.int64(num_out))[:5]

    arrays = _on_platform((routing,), on_cuda, lambda r: _run(fn, specs, r), specs)
    return JaxPlan(arrays, E, N, align_size, num_out)


# -- dispatch ------------------------------------------------------------------------------------------

def _plan_facts(plan, H, dtype, has_probs):
    T, K, E, N = _plan_dims(plan)
    return dict(T=T, K=K, E=E, N=N, align_size=plan.align_size, H=int(H), dtype=_dtype_code(dtype),
                has_probs=bool(has_probs))


def _slot_probs(probs, plan_arrays):
    """Slot probs ``[T,K]`` float32 from ``[T,K]`` or dense ``[T,E]`` probs (each slot's expert recovered
    from the plan's segments; dropped slots 0), as moe_rt.permutation does before its kernels."""
    dst, _, seg = plan_arrays[:3]
    if tuple(probs.shape) != tuple(dst.shape):
        e = jnp.minimum(jnp.searchsorted(seg[1:], dst, side="right"), seg.shape[0] - 2)
        probs = jnp.where(dst >= 0, jnp.take_along_axis(probs, e, axis=1), 0)
    return probs.astype(jnp.float32)


def _dispatch_impl(x, plan, probs, probs_f32=False):
    static = plan.static
    pdt = np.float32 if probs is None or probs_f32 else probs.dtype
    specs = [_spec((plan.num_rows, x.shape[1]), x.dtype), _spec((plan.num_rows if probs is not None else 0,), pdt)]
    pkw = {"probs_dtype": "float32"} if probs_f32 else {}

    def fn(xv, pv, *pa):
        xp_, pp = _perm.dispatch(xv, _as_plan(pa, static), pv, **pkw)
        return [xp_, pp]

    def on_cuda(x, probs, *pa):
        facts = _plan_facts(plan, x.shape[1], x.dtype, probs is not None)
        _xla.prepare("dispatch", probs_dtype=_dtype_code(pdt), **facts)
        extra = () if probs is None else (_slot_probs(probs, pa),)
        return _ffi("dispatch", specs, *pa, x, *extra, align_size=np.int32(plan.align_size))

    out = _on_platform((x, probs, *plan.arrays), on_cuda, lambda *a: _run(fn, specs, *a), specs)
    return out[0], (out[1] if probs is not None else None)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, plan, probs, probs_f32=False):
    return _dispatch_impl(x, plan, probs, probs_f32)


def _dispatch_fwd(x, plan, probs, probs_f32=False):
    return _dispatch_impl(x, plan, probs, probs_f32), (plan, probs)


def _dispatch_bwd(probs_f32, res, cts):
    plan, probs = res
    has_probs = probs is not None
    g_xp, g_pp = cts
    static = plan.static
    T, K = plan.arrays[0].shape
    specs = [_spec((T, g_xp.shape[1]), g_xp.dtype), _spec((T, K) if has_probs else (0,), np.float32)]

    def fn(gv, gpv, *pa):
        gx, gp = _perm.dispatch_backward(gv, _as_plan(pa, static), gpv)
        return [gx, gp]

    def on_cuda(g, gpp, *pa):
        _xla.prepare("dispatch_backward", **_plan_facts(plan, g.shape[1], g.dtype, gpp is not None))
        extra = () if gpp is None else (gpp.astype(jnp.float32),)
        return _ffi("dispatch_backward", specs, *pa, g, *extra, align_size=np.int32(plan.align_size))

    gx, gp = _on_platform((g_xp, g_pp if has_probs else None, *plan.arrays), on_cuda,
                          lambda *a: _run(fn, specs, *a), specs)
    return gx, None, (gp.astype(probs.dtype) if has_probs else None)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def _plan_dims(plan):
    T, K = plan.arrays[0].shape
    return int(T), int(K), plan.num_experts, plan.num_rows


def dispatch(x, plan: JaxPlan, probs=None, *, probs_dtype=None):
    """Differentiable :func:`moe_rt.permutation.dispatch`: ``x [T,H]`` into the plan's expert-major rows;
    ``probs`` None or ``[T,K]``. Returns ``(x_permuted [N,H], probs_permuted [N] or None)``, the probs in
    their own dtype (``probs_dtype=None``) or fp32 (``"float32"``). Shapes, dtypes and settings are checked
    when traced."""
    x, probs = _array(x, "x"), _array(probs, "probs", optional=True)
    _check_plan(plan)
    T, K, E, _ = _plan_dims(plan)
    _perm.check_dispatch_args(x, probs, T, K, E, probs_dtype)
    return _dispatch(x, plan, probs, probs_dtype is not None)  # a probs_dtype that passed is float32


# -- combine -------------------------------------------------------------------------------------------

def _combine_impl(y_p, plan, probs):
    static = plan.static
    T = plan.arrays[0].shape[0]

    specs = [_spec((T, y_p.shape[1]), y_p.dtype)]

    def fn(yv, pv, *pa):
        return [_perm.combine(yv, _as_plan(pa, static), pv)]

    def on_cuda(y_p, probs, *pa):
        _xla.prepare("combine", **_plan_facts(plan, y_p.shape[1], y_p.dtype, probs is not None))
        extra = () if probs is None else (_slot_probs(probs, pa),)
        return _ffi("combine", specs, *pa, y_p, *extra, align_size=np.int32(plan.align_size))

    return _on_platform((y_p, probs, *plan.arrays), on_cuda, lambda *a: _run(fn, specs, *a), specs)[0]


@jax.custom_vjp
def _combine(y_p, plan, probs):
    return _combine_impl(y_p, plan, probs)


def _combine_fwd(y_p, plan, probs):
    return _combine_impl(y_p, plan, probs), (plan, y_p if probs is not None else None, probs)


def _combine_bwd(res, g):
    plan, y_p, probs = res
    static = plan.static
    T, K = plan.arrays[0].shape
    specs = [_spec((plan.num_rows, g.shape[1]), g.dtype), _spec((T, K) if probs is not None else (0,), np.float32)]

    def fn(gv, yv, pv, *pa):
        gyp, gp = _perm.combine_backward(gv, _as_plan(pa, static), yv, pv)
        return [gyp, gp]

    def on_cuda(g, y_p, probs, *pa):
        _xla.prepare("combine_backward", **_plan_facts(plan, g.shape[1], g.dtype, probs is not None))
        extra = () if probs is None else (y_p, _slot_probs(probs, pa))
        return _ffi("combine_backward", specs, *pa, g, *extra, align_size=np.int32(plan.align_size))

    gyp, gp = _on_platform((g, y_p, probs, *plan.arrays), on_cuda, lambda *a: _run(fn, specs, *a), specs)
    return gyp, None, (gp.astype(probs.dtype) if probs is not None else None)


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(y_permuted, plan: JaxPlan, probs=None):
    """Differentiable :func:`moe_rt.permutation.combine`: ``y[t] = sum_k w[t,k] * y_permuted[dst_row[t,k]]``
    with fp32 accumulation; gradients flow to ``y_permuted`` and ``probs``. Shapes and dtypes are checked
    when traced."""
    y_permuted, probs = _array(y_permuted, "y_permuted"), _array(probs, "probs", optional=True)
    _check_plan(plan)
    T, K, E, N = _plan_dims(plan)
    _perm.check_combine_args(y_permuted, probs, T, K, E, N)
    return _combine(y_permuted, plan, probs)


# -- router --------------------------------------------------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6, 8, 9))
def _topk(logits, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor, expert_bias,
          routing_map_format="bytemap", index_dtype=None):
    return _topk_fwd(logits, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor,
                     expert_bias, routing_map_format, index_dtype)[0]


def _routing_spec(shape, topk, routing_map_format, index_dtype):
    lead = tuple(shape[:-1])
    if index_dtype is not None:
        return _spec(lead + (topk,), index_dtype)
    if routing_map_format == "bitmap_u8":
        return _spec(lead + (_rt.bitmap_bytes(shape[-1]),), np.uint8)
    return _spec(shape, np.bool_)


def _topk_fwd(logits, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor,
              expert_bias, routing_map_format="bytemap", index_dtype=None):
    specs = [_spec(logits.shape, logits.dtype), _routing_spec(logits.shape, topk, routing_map_format, index_dtype),
             _spec(logits.shape, np.float32)]
    extra = {}
    if routing_map_format != "bytemap":
        extra["routing_map_format"] = routing_map_format
    if index_dtype is not None:
        extra["topk_indices_dtype"] = index_dtype

    def fn(lv, bv):
        return list(_rt.topk_with_score(lv, topk, score_function=score_function,
                                        use_pre_softmax=use_pre_softmax, num_groups=num_groups,
                                        group_topk=group_topk, scaling_factor=scaling_factor,
                                        expert_bias=bv, **extra))

    def on_cuda(lv, bv):
        E, K, G, g, scale, pre = _rt.check_topk_args(lv, bv, topk, score_function, use_pre_softmax, num_groups,
                                                     group_topk, scaling_factor)
        T = int(np.prod(lv.shape[:-1]))
        facts = dict(topk=K, score_function=_xla.SCORE_CODES[score_function], use_pre_softmax=int(bool(pre)),
                     num_groups=int(G or 0), group_topk=int(g or 0), scaling_factor=float(np.float32(scale)))
        rspec = _routing_spec((T, E), K, routing_map_format, index_dtype)
        _xla.prepare("topk_with_score", dtype=_dtype_code(lv.dtype), T=T, E=E, has_bias=bv is not None,
                     routing_dtype=_dtype_code(rspec.dtype), **facts)
        flat = [_spec((T, E), lv.dtype), rspec, _spec((T, E), np.float32)]
        args = (lv.reshape(T, E),) + (() if bv is None else (bv.astype(jnp.float32),))
        outs = _ffi("topk_with_score", flat, *args, has_bias=np.int32(bv is not None), **_attrs(facts))
        return [o.reshape(sp.shape) for o, sp in zip(outs, specs)]

    probs, routing_map, inter = _on_platform((logits, expert_bias), on_cuda, lambda *a: _run(fn, specs, *a), specs)
    return (probs, routing_map), (routing_map, inter, expert_bias)


def _topk_bwd(topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor, routing_map_format,
              index_dtype, res, cts):
    routing_map, inter, expert_bias = res
    g_probs = cts[0]

    def fn(gv, mv, iv):
        kw = dict(score_function=score_function, use_pre_softmax=use_pre_softmax, scaling_factor=scaling_factor)
        if index_dtype is not None:
            return [_rt.topk_with_score_backward(gv, None, iv, topk, topk_indices=mv, **kw)]
        if routing_map_format != "bytemap":
            kw["routing_map_format"] = routing_map_format
        return [_rt.topk_with_score_backward(gv, mv, iv, topk, **kw)]

    specs = [_spec(g_probs.shape, g_probs.dtype)]
    on_cuda = partial(_topk_bwd_cuda, topk, score_function, use_pre_softmax, scaling_factor)
    (g,) = _on_platform((g_probs, routing_map, inter), on_cuda, lambda *a: _run(fn, specs, *a), specs)
    return g, (None if expert_bias is None else jnp.zeros_like(expert_bias))


def _attrs(facts):
    """Static facts as the custom call's attributes (scaling_factor and coeff float32, the others int32)."""
    return {k: (np.float32(v) if k in ("scaling_factor", "coeff") else np.int32(v)) for k, v in facts.items()}


def _topk_bwd_cuda(topk, score_function, use_pre_softmax, scaling_factor, gv, mv, iv):
    """The top-k backward's custom call, from the forward's routing in any of its forms (its dtype says)."""
    E = int(gv.shape[-1])
    T = int(np.prod(gv.shape[:-1]))
    scale = 1.0 if scaling_factor is None else float(np.float32(scaling_factor))
    pre = int(bool(use_pre_softmax) and score_function == "softmax")
    facts = dict(topk=int(topk), score_function=_xla.SCORE_CODES[score_function], use_pre_softmax=pre,
                 scaling_factor=scale)
    _xla.prepare("topk_with_score_backward", dtype=_dtype_code(gv.dtype), T=T, E=E,
                 routing_dtype=_dtype_code(mv.dtype), **facts)
    (out,) = _ffi("topk_with_score_backward", [_spec((T, E), gv.dtype)], gv.reshape(T, E),
                  mv.reshape(T, mv.shape[-1]), iv.reshape(T, E), **_attrs(facts))
    return [out.reshape(gv.shape)]


_topk.defvjp(_topk_fwd, _topk_bwd)


def topk_with_score(logits, topk: int, *, score_function: str = "softmax", use_pre_softmax: bool = False,
                    num_groups=None, group_topk=None, scaling_factor=None, expert_bias=None,
                    routing_map_format: str = "bytemap", topk_indices_dtype=None):
    """Differentiable :func:`moe_rt.router.topk_with_score` for JAX: ``(probs [T,E] logits dtype,
    routing_map [T,E] bool)``; the gradient flows to ``logits`` (the expert bias gets a zero one). Shapes,
    dtypes and settings are checked when traced, as the core op checks them.

    ``routing_map_format="bitmap_u8"``: the map bit-packed (uint8 ``[T, ceil(E/8)]``). ``topk_indices_dtype``
    (int16, int32, or int64 with ``jax_enable_x64``): the dense indices ``[T, K]`` instead of a map, ascending
    expert id per row, and the backward from them (JAX arrays are immutable: there is no buffer form)."""
    logits, expert_bias = _array(logits, "logits"), _array(expert_bias, "expert_bias", optional=True)
    _rt.check_topk_args(logits, expert_bias, topk, score_function, use_pre_softmax, num_groups, group_topk,
                        scaling_factor)
    _, idt = _rt.check_topk_outputs(logits, topk, routing_map_format, None, topk_indices_dtype)
    if idt is not None and idt.itemsize == 8 and not jax.config.jax_enable_x64:
        raise ValueError("topk_indices_dtype: int64 arrays need jax_enable_x64 (JAX would make them int32); "
                         "enable it or pass int32")
    return _topk(logits, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor,
                 expert_bias, routing_map_format, None if idt is None else idt.name)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _qb(logits, expert_bias, qb_histogram, qb_bin_bounds, topk, qb_histogram_mode, scaling_factor):
    return _qb_fwd(logits, expert_bias, qb_histogram, qb_bin_bounds, topk, qb_histogram_mode, scaling_factor)[0]


def _qb_fwd(logits, expert_bias, qb_histogram, qb_bin_bounds, topk, qb_histogram_mode, scaling_factor):
    specs = [_spec(logits.shape, logits.dtype), _spec(logits.shape, np.bool_), _spec(logits.shape, np.float32),
             _spec(qb_histogram.shape, np.int32)]

    def fn(lv, bv, hv, dv):
        # the new histogram: a copy of the old one (on the GPU allocated in XLA's output buffer), accumulated
        hist = _arrays.cupy_of(hv).copy()
        probs, routing_map, inter, _ = _rt.topk_with_score_qb(
            lv, topk, expert_bias=bv, qb_histogram=hist, qb_bin_bounds=dv, qb_histogram_mode=qb_histogram_mode,
            scaling_factor=scaling_factor, bounds_validated=True)
        return [probs, routing_map, inter, hist]

    def on_cuda(lv, bv, hv, dv):
        E = int(lv.shape[-1])
        T = int(np.prod(lv.shape[:-1]))
        facts = dict(topk=int(topk), qb_histogram_mode=_xla.QB_MODE_CODES[qb_histogram_mode],
                     scaling_factor=1.0 if scaling_factor is None else float(np.float32(scaling_factor)))
        _xla.prepare("topk_with_score_qb", dtype=_dtype_code(lv.dtype), T=T, E=E, num_bins=int(hv.shape[1]), **facts)
        flat = [_spec((T, E), lv.dtype), _spec((T, E), np.bool_), _spec((T, E), np.float32), specs[3],
                _spec((T,), np.float32)]
        # the new histogram is written over the old one's buffer (aliased: XLA copies the old one there first
        # unless it may be overwritten), then the counts are added to it in place; where XLA still gives the
        # result its own buffer (inside a sequential vmap's loop) the handler copies the old histogram there first
        outs = jax.ffi.ffi_call(_xla.target("topk_with_score_qb"), flat, vmap_method="sequential",
                                input_output_aliases={2: 3})(lv.reshape(T, E), bv.astype(jnp.float32), hv, dv,
                                                            **_attrs(facts))
        return [o.reshape(sp.shape) for o, sp in zip(outs[:4], specs)]

    probs, routing_map, inter, hist = _on_platform((logits, expert_bias, qb_histogram, qb_bin_bounds), on_cuda,
                                                   lambda *a: _run(fn, specs, *a), specs)
    return (probs, routing_map, hist), (routing_map, inter, expert_bias, qb_histogram, qb_bin_bounds)


def _qb_bwd(topk, qb_histogram_mode, scaling_factor, res, cts):
    routing_map, inter, expert_bias, hist, bounds = res
    g_probs = cts[0]

    def fn(gv, mv, iv):
        return [_rt.topk_with_score_backward(gv, mv, iv, topk, score_function="sigmoid",
                                             scaling_factor=scaling_factor)]

    specs = [_spec(g_probs.shape, g_probs.dtype)]
    on_cuda = partial(_topk_bwd_cuda, topk, "sigmoid", False, scaling_factor)  # the top-k backward's call
    (g,) = _on_platform((g_probs, routing_map, inter), on_cuda, lambda *a: _run(fn, specs, *a), specs)
    return g, jnp.zeros_like(expert_bias), _float0_like(hist), jnp.zeros_like(bounds)


_qb.defvjp(_qb_fwd, _qb_bwd)


def topk_with_score_qb(logits, topk: int, *, expert_bias, qb_histogram, qb_bin_bounds,
                       qb_histogram_mode: str = "fused_atomic", scaling_factor=None):
    """Differentiable :func:`moe_rt.router.topk_with_score_qb` for JAX, functional: returns ``(probs [T,E]
    logits dtype, routing_map [T,E] bool, new_histogram [E,B] int32)``, the new histogram being
    ``qb_histogram`` plus this call's counts (JAX arrays are immutable; under ``jit`` with donation XLA may
    reuse the old buffer). The gradient flows to ``logits`` (the sigmoid backward over the k routes); the
    bias and bounds get zero ones. Shapes, dtypes and settings are checked when traced; the bounds' values
    (finite, lower < upper) are checked on the host when they are concrete, and are read on the device
    unchecked when traced."""
    logits = _array(logits, "logits")
    # None for a required array: the core op's TypeError (checked below)
    expert_bias, qb_histogram, qb_bin_bounds = (_array(a, n, optional=True) for a, n in (
        (expert_bias, "expert_bias"), (qb_histogram, "qb_histogram"), (qb_bin_bounds, "qb_bin_bounds")))
    _rt.check_qb_args(logits, expert_bias, qb_histogram, qb_bin_bounds, topk, "sigmoid", None, None, scaling_factor,
                      qb_histogram_mode)
    if not isinstance(qb_bin_bounds, jax.core.Tracer):
        lo, hi = np.asarray(qb_bin_bounds, dtype=np.float32).reshape(2)
        _rt.check_qb_bounds_values(lo, hi)
    return _qb(logits, expert_bias, qb_histogram, qb_bin_bounds, int(topk), qb_histogram_mode, scaling_factor)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _scores(logits, topk, score_function, routing_map_format="bytemap"):
    return _scores_fwd(logits, topk, score_function, routing_map_format)[0]


def _scores_fwd(logits, topk, score_function, routing_map_format="bytemap"):
    specs = [_spec(logits.shape, np.float32), _routing_spec(logits.shape, topk, routing_map_format, None),
             _spec(logits.shape, np.float32)]
    kw = {} if routing_map_format == "bytemap" else {"routing_map_format": routing_map_format}

    def on_cuda(lv):
        E = int(lv.shape[-1])
        T = int(np.prod(lv.shape[:-1]))
        facts = dict(topk=int(topk), score_function=_xla.SCORE_CODES[score_function])
        rspec = _routing_spec((T, E), topk, routing_map_format, None)
        _xla.prepare("scores_for_aux_loss", dtype=_dtype_code(lv.dtype), T=T, E=E,
                     routing_dtype=_dtype_code(rspec.dtype), **facts)
        outs = _ffi("scores_for_aux_loss", [_spec((T, E), np.float32), rspec, _spec((T, E), np.float32)],
                    lv.reshape(T, E), **_attrs(facts))
        return [o.reshape(sp.shape) for o, sp in zip(outs, specs)]

    scores, routing_map, inter = _on_platform(
        (logits,), on_cuda, lambda lv: _run(lambda v: list(_rt.scores_for_aux_loss(v, topk, score_function, **kw)),
                                            specs, lv), specs)
    return (scores, routing_map), (inter, jnp.zeros((0,), logits.dtype))


def _scores_bwd(topk, score_function, routing_map_format, res, cts):
    inter, like = res
    g_scores = cts[0].astype(jnp.float32)
    specs = [_spec(g_scores.shape, like.dtype)]

    def fn(gv, iv):
        return [_rt.scores_for_aux_loss_backward(gv, iv, topk, score_function, dtype=like.dtype)]

    def on_cuda(gv, iv):
        E = int(gv.shape[-1])
        T = int(np.prod(gv.shape[:-1]))
        facts = dict(topk=int(topk), score_function=_xla.SCORE_CODES[score_function])
        _xla.prepare("scores_for_aux_loss_backward", dtype=_dtype_code(like.dtype), T=T, E=E, **facts)
        (out,) = _ffi("scores_for_aux_loss_backward", [_spec((T, E), like.dtype)], gv.reshape(T, E),
                      iv.reshape(T, E), **_attrs(facts))
        return [out.reshape(gv.shape)]

    (g,) = _on_platform((g_scores, inter), on_cuda, lambda *a: _run(fn, specs, *a), specs)
    return (g,)


_scores.defvjp(_scores_fwd, _scores_bwd)


def scores_for_aux_loss(logits, topk: int, score_function: str, *, routing_map_format: str = "bytemap"):
    """Differentiable :func:`moe_rt.router.scores_for_aux_loss` for JAX: ``(scores [T,E] fp32,
    routing_map [T,E] bool)``; ``routing_map_format="bitmap_u8"``: the map bit-packed (uint8
    ``[T, ceil(E/8)]``). Shapes, dtypes and settings are checked when traced."""
    logits = _array(logits, "logits")
    _rt.check_map_format(routing_map_format)
    _rt.check_scores_args(logits, topk, score_function)
    return _scores(logits, topk, score_function, routing_map_format)


_TPE_CODES = ("int32", "int64", "float32")  # what the aux kernels read as it is (others: as float32)


def _aux_call(op, first, tpe, total, out_spec, host_total, num_experts, topk, coeff, fn):
    """The aux loss's forward (``first``: probs) or backward (``first``: the loss's gradient) as a custom
    call on CUDA (a device ``total`` read at launch, else ``host_total``), ``fn`` on the CPU."""
    specs = [out_spec]

    def on_cuda(first, tpe, total):
        if jnp.dtype(tpe.dtype).name not in _TPE_CODES:
            tpe = tpe.astype(jnp.float32)
        R, C = (first.shape if op == "aux_loss" else out_spec.shape)
        facts = dict(num_experts=num_experts, topk=topk, coeff=coeff)
        _xla.prepare(op, dtype=_dtype_code(first.dtype), R=int(R), C=int(C), tpe_dtype=_dtype_code(tpe.dtype),
                     dev_total=total is not None, **facts)
        rets = [out_spec]
        if op == "aux_loss":
            rets.append(_spec((_xla.aux_loss_workspace_bytes(int(R)),), np.uint8))
        extra = () if total is None else (total.reshape(()),)
        outs = _ffi(op, rets, first, tpe, *extra, total_num_tokens=np.int64(host_total), **_attrs(facts))
        return outs[:1]

    return _on_platform((first, tpe, total), on_cuda, lambda *a: _run(fn, specs, *a), specs)[0]


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _aux(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    return _aux_fwd(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)[0]


def _aux_fwd(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    def fn(pv, tv, _):
        return [_rt.aux_loss(pv, tv, total_num_tokens, num_experts, topk, coeff).reshape(())]

    loss = _aux_call("aux_loss", probs, tokens_per_expert, None, _spec((), probs.dtype), total_num_tokens,
                     num_experts, topk, coeff, fn)
    return loss, (tokens_per_expert, jnp.zeros((probs.shape[0], 0), probs.dtype))


def _aux_bwd(total_num_tokens, num_experts, topk, coeff, res, g):
    tpe, like = res
    R = like.shape[0]

    def fn(gv, tv, _):
        return [_rt.aux_loss_backward(gv, R, tv, total_num_tokens, num_experts, topk, coeff)]

    gp = _aux_call("aux_loss_backward", g, tpe, None, _spec((R, tpe.shape[0]), g.dtype), total_num_tokens,
                   num_experts, topk, coeff, fn)
    return gp.astype(like.dtype), _float0_like(tpe)


_aux.defvjp(_aux_fwd, _aux_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _aux_dev(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    return _aux_dev_fwd(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)[0]


def _aux_dev_fwd(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    def fn(pv, tv, nv):
        return [_rt.aux_loss(pv, tv, nv, num_experts, topk, coeff).reshape(())]

    loss = _aux_call("aux_loss", probs, tokens_per_expert, total_num_tokens, _spec((), probs.dtype), 0,
                     num_experts, topk, coeff, fn)
    return loss, (tokens_per_expert, total_num_tokens, jnp.zeros((probs.shape[0], 0), probs.dtype))


def _float0_like(a):
    return jnp.zeros_like(a) if jnp.issubdtype(a.dtype, jnp.floating) else np.zeros(a.shape, jax.dtypes.float0)


def _aux_dev_bwd(num_experts, topk, coeff, res, g):
    tpe, total, like = res
    R = like.shape[0]

    def fn(gv, tv, nv):
        return [_rt.aux_loss_backward(gv, R, tv, nv, num_experts, topk, coeff)]

    gp = _aux_call("aux_loss_backward", g, tpe, total, _spec((R, tpe.shape[0]), g.dtype), 0, num_experts, topk,
                   coeff, fn)
    return gp.astype(like.dtype), _float0_like(tpe), _float0_like(total)


_aux_dev.defvjp(_aux_dev_fwd, _aux_dev_bwd)


def aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts: int, topk: int, coeff: float):
    """Differentiable :func:`moe_rt.router.aux_loss` for JAX: a 0-d loss; the gradient flows to ``probs``.
    ``total_num_tokens``: a Python int (static), or a 0-d int32/int64 array (traced: read on the device,
    so one compiled step serves every value). Shapes, dtypes and settings are checked when traced."""
    probs, tokens_per_expert = _array(probs, "probs"), _array(tokens_per_expert, "tokens_per_expert")
    device_total = not _rt._is_int(total_num_tokens) and hasattr(total_num_tokens, "shape")
    if device_total:
        total_num_tokens = jnp.asarray(total_num_tokens)
    _rt.check_aux_loss_args(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)
    if device_total:
        return _aux_dev(probs, tokens_per_expert, total_num_tokens, int(num_experts), int(topk), float(coeff))
    return _aux(probs, tokens_per_expert, int(total_num_tokens), int(num_experts), int(topk), float(coeff))


# -- chunk sort ----------------------------------------------------------------------------------------

def _chunk_array(a, name):
    if isinstance(a, (jax.Array, jax.core.Tracer)):
        _arrays.check_ndim(a, name, 1)
        _arrays.check_dtype(a, name, _arrays.INDEX_DTYPES)  # as the core op takes them
        return a
    return jnp.asarray(np.asarray(a), dtype=jnp.int32)


def _sort_chunks_run(x, s, o, probs, bwd):
    specs = [_spec(x.shape, x.dtype), _spec((x.shape[0] if probs is not None else 0,), np.float32)]
    f = _perm.sort_chunks_backward if bwd else _perm.sort_chunks

    def fn(xv, sv, ov, pv):
        if pv is None:
            return [f(xv, sv, ov), None]
        return list(f(xv, sv, ov, **({"grad_probs": pv} if bwd else {"probs": pv})))

    def on_cuda(xv, sv, ov, pv):
        if sv.dtype != ov.dtype:
            sv, ov = sv.astype(jnp.int32), ov.astype(jnp.int32)
        S = int(sv.shape[0])
        row_bytes = int(np.prod(xv.shape[1:], dtype=np.int64)) * jnp.dtype(xv.dtype).itemsize
        _xla.prepare("sort_chunks", N=int(xv.shape[0]), row_bytes=row_bytes, S=S, index_dtype=_dtype_code(sv.dtype),
                     backward=int(bwd), has_probs=pv is not None)
        ws = _spec((_xla.sort_chunks_workspace_bytes(S),), np.uint8)
        extra = () if pv is None else (pv.astype(jnp.float32),)
        return _ffi("sort_chunks", specs + [ws], xv, sv, ov, *extra, backward=np.int32(bwd))[:2]

    out, po = _on_platform((x, s, o, probs), on_cuda, lambda *a: _run(fn, specs, *a), specs)
    return out, (po if probs is not None else None)


@jax.custom_vjp
def _sort_chunks(x, s, o, probs):
    return _sort_chunks_run(x, s, o, probs, False)


def _sort_chunks_fwd(x, s, o, probs):
    return _sort_chunks_run(x, s, o, probs, False), (s, o, None if probs is None else jnp.zeros((0,), probs.dtype))


def _sort_chunks_bwd(res, cts):
    s, o, like = res
    g, gp = cts
    gx, gpx = _sort_chunks_run(g, s, o, None if like is None else gp.astype(jnp.float32), True)
    return gx, _float0_like(s), _float0_like(o), (None if like is None else gpx.astype(like.dtype))


_sort_chunks.defvjp(_sort_chunks_fwd, _sort_chunks_bwd)


def sort_chunks(x, split_sizes, sorted_indices, probs=None):
    """Differentiable :func:`moe_rt.permutation.sort_chunks` for JAX (jit-compatible): the rows of
    ``x [N, ...]`` form chunks of sizes ``split_sizes`` put in the order ``sorted_indices`` (int arrays,
    traced or not; lists and NumPy arrays are validated at trace time). Returns ``out`` or, with
    ``probs [N]``, ``(out, probs_out [N] fp32)``; gradients flow to ``x`` and ``probs``."""
    x, probs = _array(x, "x"), _array(probs, "probs", optional=True)
    if x.ndim < 1:
        raise ValueError(f"x: expected at least 1 dimension, got shape {tuple(x.shape)}")
    _arrays.check_dtype(x, "x", _perm.CHUNK_DTYPES)
    N = int(x.shape[0])
    hs, ho = (None if isinstance(a, jax.Array) else _perm.host_chunk_array(a, n)
              for a, n in ((split_sizes, "split_sizes"), (sorted_indices, "sorted_indices")))
    s, o = _chunk_array(split_sizes, "split_sizes"), _chunk_array(sorted_indices, "sorted_indices")
    if s.shape[0] != o.shape[0]:
        raise ValueError(f"sorted_indices: expected {s.shape[0]} entries (one per chunk of split_sizes), "
                         f"got {o.shape[0]}")
    # arrays already in host memory: their values checked at once, as the core op checks them on the CPU
    _perm.check_chunk_values(hs if hs is not None else _host_values(s), ho if ho is not None else _host_values(o), N)
    if probs is not None:
        _arrays.check_shape(probs, "probs", (N,))
        _arrays.check_dtype(probs, "probs", _perm._PROB_DTYPES)
    out, po = _sort_chunks(x, s, o, probs)
    return out if probs is None else (out, po)


# -- FP8 quantization --------------------------------------------------------------------------------

def quantize_fp8(x, block: int = 128):
    """:func:`moe_rt.fp8.quantize_fp8` for JAX (jit-compatible): ``x [T,H]`` fp32/bf16/fp16 ->
    ``(x_fp8 [T,H] float8_e4m3fn, scales [T, ceil(H/block)] float32)``. Not differentiable (use
    ``jax.lax.stop_gradient`` on ``x`` inside a differentiated function). Checked when traced."""
    x = _array(x, "x")
    T, H, nb = _fp8.check_quantize_args(x, block)
    specs = [_spec((T, H), _arrays.FLOAT8_E4M3), _spec((T, nb), np.float32)]

    def on_cuda(xv):
        _xla.prepare("quantize_fp8", dtype=_dtype_code(xv.dtype), T=T, H=H, block=int(block))
        return _ffi("quantize_fp8", specs, xv, block=np.int32(block))

    q, s = _on_platform((x,), on_cuda, lambda xv: _run(lambda v: list(_fp8.quantize_fp8(v, block)), specs, xv),
                        specs)
    return q, s


def dequantize_fp8(x_fp8, scales, dtype=jnp.bfloat16, block: int = 128):
    """:func:`moe_rt.fp8.dequantize_fp8` for JAX (jit-compatible): ``y [T,H]`` in ``dtype`` (float32,
    float16 or bfloat16). Not differentiable. Checked when traced."""
    x_fp8, scales = _array(x_fp8, "x_fp8"), _array(scales, "scales")
    T, H, _, dt = _fp8.check_dequantize_args(x_fp8, scales, dtype, block)
    specs = [_spec((T, H), dt)]

    def fn(qv, sv):
        return [_fp8.dequantize_fp8(qv, sv, dt, block)]

    def on_cuda(qv, sv):
        _xla.prepare("dequantize_fp8", dtype=_dtype_code(dt), T=T, H=H, block=int(block))
        return _ffi("dequantize_fp8", specs, qv, sv, block=np.int32(block))

    return _on_platform((x_fp8, scales), on_cuda, lambda *a: _run(fn, specs, *a), specs)[0]


# -- expert parallelism ------------------------------------------------------------------------------

from moe_rt._jax_ep import JaxEpHandle, ep_combine, ep_dispatch, ep_path, ep_prepare  # noqa: E402
from moe_rt._jax_ep import JaxLLHandle, ll_combine, ll_dispatch  # noqa: E402

__all__ += ["JaxLLHandle", "ll_dispatch", "ll_combine"]
