"""PyTorch adapters: autograd-aware moe_rt ops on torch's current stream.

Every op is registered as a ``torch.library`` custom op (namespace ``moe_rt``) with a fake
implementation, so models using them compile under ``torch.compile`` without graph breaks, and with an
autograd formula that calls moe_rt's backward kernels. CUDA tensors run the kernels, CPU tensors the NumPy
reference; outputs are zero-copy views of moe_rt's results.

Outside ``torch.compile`` (eager mode) the same ops run through a lean ``torch.autograd.Function`` path
that calls moe_rt directly, with the same results and gradients: the custom-op machinery costs more host
time per call than the kernels themselves at small sizes. Under ``torch.compile`` the custom ops are traced.

Dispatch plans travel between ops as plain tensors: :func:`make_plan` returns a :class:`TorchPlan`
(a tuple of int32 tensors plus the static ints), which :func:`dispatch` and :func:`combine` take.
"""
from __future__ import annotations

import math
import weakref
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from moe_rt import _arrays
from moe_rt import fp8 as _fp8
from moe_rt import permutation as _perm
from moe_rt import router as _rt

__all__ = ["TorchPlan", "make_plan", "dispatch", "combine", "topk_with_score", "topk_with_score_qb",
           "scores_for_aux_loss", "aux_loss", "sort_chunks", "quantize_fp8", "dequantize_fp8", "TorchEpHandle",
           "ep_prepare", "ep_dispatch", "ep_combine"]


def _eager() -> bool:
    """True outside torch.compile tracing: the lean autograd.Function path runs instead of the custom op."""
    return not _is_compiling()


_is_compiling = torch.compiler.is_compiling


def _needs_grad(a: Tensor, b: Optional[Tensor] = None) -> bool:
    return torch.is_grad_enabled() and (a.requires_grad or (b is not None and b.requires_grad))


# torch.autograd.Function.apply is a Python layer over torch's C apply. With no functorch transform active
# (no torch.func.grad/vmap around the call) all it does for Functions like the ones here (no setup_context)
# is unwrap tensors left over from a finished transform, then call the C apply. The eager ops below do that
# unwrap themselves and call the C apply (1.1 us less per call on a quick host, more on slow ones); under a
# transform they call the full apply.
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_dead = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)


def _tensor(t, name: str, optional: bool = False) -> None:
    """TypeError unless ``t`` is a torch tensor (or None where ``optional``)."""
    if type(t) is not Tensor and not isinstance(t, Tensor) and not (optional and t is None):
        raise TypeError(f"{name}: expected a torch.Tensor{' or None' if optional else ''}, got {type(t).__name__} "
                        "(moe_rt.torch ops take torch tensors; the core ops in moe_rt take any framework's arrays)")


def _no_vmap(op: str):
    """The ``vmap`` staticmethod of an op's autograd.Function: torch.vmap is refused with a clear error."""
    def vmap(info, in_dims, *args):
        raise NotImplementedError(
            f"moe_rt.torch.{op}: torch.vmap is not supported. The ops already take a batch of tokens: fold the "
            "vmapped dimension into the token dimension (reshape to [B*T, ...]) and call the op once")
    return staticmethod(vmap)


_once = torch.autograd.function.once_differentiable


def _c_apply(fn_cls):
    """torch's C apply for ``fn_cls`` (its Function.apply minus the Python layer)."""
    return super(torch.autograd.Function, fn_cls).apply


# -- plans -------------------------------------------------------------------------------------------

class TorchPlan(NamedTuple):
    """A dispatch plan as tensors (see :class:`moe_rt.permutation.Plan`): ``dst_row [T,K]``,
    ``src_slot [N]``, ``seg_start [E+1]``, ``counts [E]``, ``tokens_per_expert [E]`` (int32), and the
    static ``num_experts``, ``num_rows``, ``align_size``, ``num_out_tokens`` (-1 = none)."""
    dst_row: Tensor
    src_slot: Tensor
    seg_start: Tensor
    counts: Tensor
    tokens_per_expert: Tensor
    num_experts: int
    num_rows: int
    align_size: int
    num_out_tokens: int


_PLAN_ARRAYS = ("dst_row", "src_slot", "seg_start", "counts", "tokens_per_expert")


def _to_plan(dst_row, src_slot, seg_start, counts, tpe, num_experts, num_rows, align_size, num_out_tokens):
    """A moe_rt Plan over the given tensors (no copy)."""
    return _perm.Plan.from_arrays(dst_row, src_slot, seg_start, counts, tpe, num_rows=num_rows,
                                  align_size=align_size, num_out_tokens=num_out_tokens)


# Eager mode: the moe_rt Plan behind each TorchPlan made by make_plan, so dispatch and combine skip
# rebuilding it from the five tensors. Keyed by id(dst_row); an entry is dropped when its dst_row tensor
# dies, and used only while every tensor and int of the TorchPlan is the one it was made with.
_plans: dict = {}


def _remember(tp: TorchPlan, plan) -> None:
    key = id(tp.dst_row)
    _plans[key] = (weakref.ref(tp.dst_row, lambda _r, k=key, d=_plans: d.pop(k, None)), tuple(tp[1:]), plan)


def _plan_of(tp: TorchPlan):
    """The moe_rt Plan of a TorchPlan (eager mode): the remembered one, else rebuilt from the tensors."""
    if not isinstance(tp, TorchPlan):
        raise TypeError(f"plan: expected a TorchPlan from moe_rt.torch.make_plan, got {type(tp).__name__}")
    ent = _plans.get(id(tp.dst_row))
    if ent is not None:
        t = ent[1]
        if (ent[0]() is tp[0] and t[0] is tp[1] and t[1] is tp[2] and t[2] is tp[3] and t[3] is tp[4]
                and t[4:] == tp[5:]):
            return ent[2]
    plan = _to_plan(*_plan_args(tp))
    _remember(tp, plan)
    return plan


_split_sizes: dict = {}  # id(plan spec) -> (spec, buffer length, the split's sizes, dst_row's T and K)


def _torch_plan(p, num_out_tokens: int) -> TorchPlan:
    """A TorchPlan over a moe_rt Plan's arrays (no copy), remembered for the eager ops."""
    v = p._v
    if p.backend == "cuda" and type(v) is _perm._PlanViews:
        # the plan's one buffer in torch (torch's own tensor, or one DLPack export), then five views of it
        buf = v._buf
        if isinstance(buf, torch.Tensor):
            whole = buf
        elif type(buf) is _arrays.DevArray and buf.offset == 0:
            o = buf.owner  # a replayed make_plan's buffer: a torch tensor
            whole = o if type(o) is torch.Tensor and o.shape == buf.shape else buf.export("torch")
        else:
            ptr = _arrays._default_stream("torch", p.device_id).ptr
            with _arrays.as_cupy_stream(ptr, p.device_id):
                whole = _arrays._torch_from_cupy(_arrays.cupy_of(buf), ptr)
        # the five arrays lie back to back at the start of the buffer, in _PLAN_ARRAYS order (the plan's
        # scratch after them): one split. It does not track the pieces as views of the buffer for autograd
        # (unsafe_split_with_sizes, a third cheaper): int32 tensors that never take part in autograd.
        spec = v._spec
        length = whole.shape[0]
        sizes = _split_sizes.get(id(spec))
        if sizes is None or sizes[0] is not spec or sizes[1] != length:
            n = [math.prod(spec[k][1]) for k in _PLAN_ARRAYS]
            if len(_split_sizes) > 512:
                _split_sizes.clear()
            T, K = spec["dst_row"][1]
            sizes = _split_sizes[id(spec)] = (spec, length, n + [length - sum(n)], T, K)
        a = whole.unsafe_split_with_sizes(sizes[2])
        tp = TorchPlan(a[0].view(sizes[3], sizes[4]), a[1], a[2], a[3], a[4], p.num_experts, p.num_rows,
                       p.align_size, num_out_tokens)
        _remember(tp, p)
        return tp
    arrays = [getattr(p, k) for k in _PLAN_ARRAYS]
    tp = TorchPlan(*arrays, p.num_experts, p.num_rows, p.align_size, num_out_tokens)
    _remember(tp, p)
    return tp


@torch.library.custom_op("moe_rt::make_plan", mutates_args=())
def _make_plan_op(routing: Tensor, num_experts: int, align_size: int,
                  num_out_tokens: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    p = _perm.make_plan(routing, num_experts, align_size=align_size,
                        num_out_tokens=None if num_out_tokens < 0 else num_out_tokens,
                        map_type=None if routing.dtype == torch.bool else "index", _apart=True)
    return tuple(getattr(p, k) for k in _PLAN_ARRAYS)


@_make_plan_op.register_fake
def _(routing, num_experts, align_size, num_out_tokens):
    T = routing.shape[0]
    K = num_experts if routing.dtype == torch.bool else routing.shape[1]
    N = _perm._num_rows(T, K, num_experts, align_size, None if num_out_tokens < 0 else num_out_tokens)
    new = lambda *s: routing.new_empty(s, dtype=torch.int32)  # noqa: E731
    return new(T, K), new(N), new(num_experts + 1), new(num_experts), new(num_experts)


_ft = getattr(torch._C, "_functorch", None)


def _plain(t: Tensor, op: str) -> Tensor:
    """``t`` without the wrappers of torch.func.grad/vjp (a plan is discrete: nothing to differentiate);
    NotImplementedError under torch.vmap."""
    if _ft is None:
        return t
    if _ft.is_batchedtensor(t):
        _no_vmap(op).__func__(None, None)
    while _ft.is_functorch_wrapped_tensor(t):
        t = _ft.get_unwrapped(t)
        if _ft.is_batchedtensor(t):
            _no_vmap(op).__func__(None, None)
    return t


def _bwd_plain(op: str, *ts):
    """A backward's tensors under torch.func.grad/vjp, where they come wrapped for the transform's level:
    unwrapped one level (first-order gradients: the backward is once differentiable). Deeper wrappers
    (nested transforms: higher-order derivatives) raise NotImplementedError, as does torch.vmap."""
    if _ft is None:
        return ts
    out = []
    for t in ts:
        if t is not None and _ft.is_functorch_wrapped_tensor(t):
            if _ft.is_batchedtensor(t):
                _no_vmap(op).__func__(None, None)
            t = _ft.get_unwrapped(t)
            if _ft.is_functorch_wrapped_tensor(t):
                raise NotImplementedError(f"moe_rt.torch.{op}: higher-order derivatives (nested torch.func "
                                          "transforms) are not supported; the backward is once differentiable")
        out.append(t)
    return out


def _routing_of(routing, num_experts, map_type):
    """``routing`` with an integer 0/1 map (``map_type="mask"``) made bool (a torch op, traceable), and
    the core's ``map_type`` for it (the rule of :func:`moe_rt.permutation.routing_kind`)."""
    if routing.dim() != 2:
        raise ValueError(f"routing: expected a 2-D array, got shape {tuple(routing.shape)}")
    np_dtype = _arrays._torch_np_dtype(routing.dtype)
    if np_dtype is None:
        raise TypeError(f"routing: expected topk_idx (int32 or int64) or a routing_map (bool), got dtype "
                        f"{routing.dtype}")
    kind = _perm.routing_kind(np_dtype, tuple(routing.shape), num_experts, map_type)
    if kind == "int_map":
        return routing != 0, None
    return routing, (None if kind == "bool_map" else "index")


def make_plan(routing: Tensor, num_experts: int, *, align_size: int = 1,
              num_out_tokens: Optional[int] = None, map_type: Optional[str] = None) -> TorchPlan:
    """:func:`moe_rt.permutation.make_plan` for torch: ``routing`` is ``topk_idx [T,K]`` (int32/int64,
    -1 = none) or ``routing_map [T,E]`` (bool, or integer 0/1 with ``map_type="mask"``); ``map_type``
    as in the core op (an integer ``[T, num_experts]`` tensor needs it). Not differentiable (routing is
    discrete)."""
    _tensor(routing, "routing")
    routing, core_map_type = _routing_of(routing, num_experts, map_type)
    if routing.dtype == torch.bool and routing.dim() == 2 and routing.shape[1] != num_experts:
        raise ValueError(f"routing: a routing_map must have shape [T, num_experts={num_experts}], "
                         f"got {tuple(routing.shape)}")
    nout = -1 if num_out_tokens is None else int(num_out_tokens)
    if routing.dim() != 2:
        raise ValueError(f"routing: expected a 2-D array, got shape {tuple(routing.shape)}")
    if _eager():
        if _functorch_active():
            routing = _plain(routing, "make_plan")
        p = _perm.make_plan(routing, num_experts, align_size=align_size, num_out_tokens=num_out_tokens,
                            map_type=core_map_type)
        return _torch_plan(p, nout)
    K = num_experts if routing.dtype == torch.bool else routing.shape[1]
    N = _perm._num_rows(routing.shape[0], K, num_experts, align_size, num_out_tokens)
    arrays = _make_plan_op(routing, int(num_experts), int(align_size), nout)
    return TorchPlan(*arrays, int(num_experts), int(N), int(align_size), nout)


def _plan_args(plan: TorchPlan):
    if not isinstance(plan, TorchPlan):
        raise TypeError(f"plan: expected a TorchPlan from moe_rt.torch.make_plan, got {type(plan).__name__}")
    return (*plan[:5], plan.num_experts, plan.num_rows, plan.align_size, plan.num_out_tokens)


def _as_dtype(t: Tensor, dtype) -> Tensor:
    """``t`` in ``dtype``; itself when it already is (``Tensor.to`` costs a dispatcher call even then)."""
    return t if t.dtype is dtype else t.to(dtype)


def _empty_probs(like: Tensor) -> Tensor:
    return like.new_empty((0,), dtype=torch.float32)


# -- dispatch ------------------------------------------------------------------------------------------

@torch.library.custom_op("moe_rt::dispatch", mutates_args=())
def _dispatch_op(x: Tensor, dst_row: Tensor, src_slot: Tensor, seg_start: Tensor, counts: Tensor,
                 tpe: Tensor, num_experts: int, num_rows: int, align_size: int, num_out_tokens: int,
                 probs: Optional[Tensor], probs_f32: bool = False) -> tuple[Tensor, Tensor]:
    plan = _to_plan(dst_row, src_slot, seg_start, counts, tpe, num_experts, num_rows, align_size,
                    num_out_tokens)
    xp, pp = _perm.dispatch(x, plan, probs, probs_dtype="float32" if probs_f32 else None)
    return xp, (_empty_probs(x) if pp is None else pp)


@_dispatch_op.register_fake
def _(x, dst_row, src_slot, seg_start, counts, tpe, num_experts, num_rows, align_size, num_out_tokens, probs,
      probs_f32=False):
    pdt = torch.float32 if probs is None or probs_f32 else probs.dtype
    return (x.new_empty((num_rows, x.shape[1])),
            x.new_empty((num_rows if probs is not None else 0,), dtype=pdt))


def _dispatch_setup(ctx, inputs, output):
    ctx.plan_args = inputs[1:10]
    ctx.has_probs = inputs[10] is not None
    ctx.probs_dtype = inputs[10].dtype if ctx.has_probs else None
    ctx.save_for_backward(*inputs[1:6])


@torch.library.custom_op("moe_rt::dispatch_backward", mutates_args=())
def _dispatch_bwd_op(grad_xp: Tensor, dst_row: Tensor, src_slot: Tensor, seg_start: Tensor, counts: Tensor,
                     tpe: Tensor, num_experts: int, num_rows: int, align_size: int, num_out_tokens: int,
                     grad_pp: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    plan = _to_plan(dst_row, src_slot, seg_start, counts, tpe, num_experts, num_rows, align_size,
                    num_out_tokens)
    gx, gp = _perm.dispatch_backward(grad_xp.contiguous(), plan, grad_pp)
    return gx, (_empty_probs(grad_xp) if gp is None else gp)


@_dispatch_bwd_op.register_fake
def _(grad_xp, dst_row, src_slot, seg_start, counts, tpe, num_experts, num_rows, align_size, num_out_tokens,
      grad_pp):
    T, K = dst_row.shape
    return (grad_xp.new_empty((T, grad_xp.shape[1])),
            grad_xp.new_empty((T, K) if grad_pp is not None else (0,), dtype=torch.float32))


def _dispatch_bwd(ctx, grad_xp, grad_pp):
    gpp = grad_pp if ctx.has_probs else None
    gx, gp = _dispatch_bwd_op(grad_xp, *ctx.saved_tensors, *ctx.plan_args[5:], gpp)
    return (gx,) + (None,) * 9 + (gp.to(ctx.probs_dtype) if ctx.has_probs else None, None)


_dispatch_op.register_autograd(_dispatch_bwd, setup_context=_dispatch_setup)


class _DispatchFn(torch.autograd.Function):
    """Eager dispatch: forward and backward straight to moe_rt."""

    @staticmethod
    def forward(x, probs, plan, probs_dtype=None):
        if probs_dtype is None:
            return _perm.dispatch(x, plan, probs)
        return _perm.dispatch(x, plan, probs, probs_dtype=probs_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, probs, plan = inputs[:3]
        ctx.set_materialize_grads(False)  # no zero tensors made for outputs that get no gradient
        ctx.plan = plan
        ctx.probs_dtype = None if probs is None else probs.dtype
        ctx.x_meta = (x.shape, x.dtype)

    vmap = _no_vmap("dispatch")

    @staticmethod
    @_once
    def backward(ctx, grad_xp, grad_pp):
        has_probs = ctx.probs_dtype is not None and grad_pp is not None
        rows_grad = grad_xp is not None
        if not rows_grad:
            if not has_probs:
                return None, None, None
            # the probs' gradient alone (x may be FP8, which has no gradient): rows of width 0
            grad_xp = torch.zeros((ctx.plan.num_rows, 0), dtype=torch.float32, device=grad_pp.device)
        grad_xp, grad_pp = _bwd_plain("dispatch", grad_xp.contiguous(), grad_pp if has_probs else None)
        gx, gp = _perm.dispatch_backward(grad_xp, ctx.plan, grad_pp)
        return (gx if rows_grad else None), (_as_dtype(gp, ctx.probs_dtype) if has_probs else None), None, None


_dispatch_apply = _c_apply(_DispatchFn)


def dispatch(x: Tensor, plan: TorchPlan, probs: Optional[Tensor] = None, *,
             probs_dtype=None) -> tuple[Tensor, Optional[Tensor]]:
    """Differentiable :func:`moe_rt.permutation.dispatch`: ``x [T,H]`` into the plan's expert-major rows.
    ``probs``: None or ``[T,K]`` slot probs (same layout as topk_idx). Returns ``(x_permuted [N,H],
    probs_permuted [N] or None)``, the probs in their own dtype (``probs_dtype=None``) or fp32
    (``"float32"`` / ``torch.float32``); gradients flow to ``x`` and ``probs``."""
    _tensor(x, "x")
    _tensor(probs, "probs", True)
    if probs_dtype is not None:
        probs_dtype = _perm._probs_dtype(probs_dtype, None).name  # "float32" (else ValueError)
    if _eager():
        p = _plan_of(plan)
        if _functorch_active():  # torch.func.grad/vjp (and vmap, which the Function refuses)
            return _DispatchFn.apply(x, probs, p, probs_dtype)
        if _needs_grad(x, probs):
            if _unwrap_dead is None:
                return _DispatchFn.apply(x, probs, p, probs_dtype)
            return _dispatch_apply(_unwrap_dead(x), None if probs is None else _unwrap_dead(probs), p, probs_dtype)
        if probs_dtype is None:
            return _perm.dispatch(x, p, probs)
        return _perm.dispatch(x, p, probs, probs_dtype=probs_dtype)
    if probs_dtype is None:
        xp, pp = _dispatch_op(x, *_plan_args(plan), probs)
    else:
        xp, pp = _dispatch_op(x, *_plan_args(plan), probs, True)
    return xp, (pp if probs is not None else None)


# -- combine -------------------------------------------------------------------------------------------

@torch.library.custom_op("moe_rt::combine", mutates_args=())
def _combine_op(y_permuted: Tensor, dst_row: Tensor, src_slot: Tensor, seg_start: Tensor, counts: Tensor,
                tpe: Tensor, num_experts: int, num_rows: int, align_size: int, num_out_tokens: int,
                probs: Optional[Tensor]) -> Tensor:
    plan = _to_plan(dst_row, src_slot, seg_start, counts, tpe, num_experts, num_rows, align_size,
                    num_out_tokens)
    return _perm.combine(y_permuted, plan, probs)


@_combine_op.register_fake
def _(y_permuted, dst_row, src_slot, seg_start, counts, tpe, num_experts, num_rows, align_size,
      num_out_tokens, probs):
    return y_permuted.new_empty((dst_row.shape[0], y_permuted.shape[1]))


def _combine_setup(ctx, inputs, output):
    ctx.plan_args = inputs[1:10]
    probs = inputs[10]
    ctx.has_probs = probs is not None
    ctx.probs_dtype = probs.dtype if probs is not None else None
    ctx.save_for_backward(*inputs[1:6], inputs[0] if probs is not None else None, probs)


@torch.library.custom_op("moe_rt::combine_backward", mutates_args=())
def _combine_bwd_op(grad_y: Tensor, dst_row: Tensor, src_slot: Tensor, seg_start: Tensor, counts: Tensor,
                    tpe: Tensor, num_experts: int, num_rows: int, align_size: int, num_out_tokens: int,
                    y_permuted: Optional[Tensor], probs: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    plan = _to_plan(dst_row, src_slot, seg_start, counts, tpe, num_experts, num_rows, align_size,
                    num_out_tokens)
    gyp, gp = _perm.combine_backward(grad_y.contiguous(), plan, y_permuted, probs)
    return gyp, (_empty_probs(grad_y) if gp is None else gp)


@_combine_bwd_op.register_fake
def _(grad_y, dst_row, src_slot, seg_start, counts, tpe, num_experts, num_rows, align_size, num_out_tokens,
      y_permuted, probs):
    return (grad_y.new_empty((num_rows, grad_y.shape[1])),
            grad_y.new_empty(tuple(dst_row.shape) if probs is not None else (0,), dtype=torch.float32))


def _combine_bwd(ctx, grad_y):
    dst, src, seg, cnt, tpe, y_p, probs = ctx.saved_tensors
    gyp, gp = _combine_bwd_op(grad_y, dst, src, seg, cnt, tpe, *ctx.plan_args[5:], y_p, probs)
    return (gyp,) + (None,) * 9 + (gp.to(ctx.probs_dtype) if ctx.has_probs else None,)


_combine_op.register_autograd(_combine_bwd, setup_context=_combine_setup)


class _CombineFn(torch.autograd.Function):
    """Eager combine: forward and backward straight to moe_rt."""

    @staticmethod
    def forward(y_permuted, probs, plan):
        return _perm.combine(y_permuted, plan, probs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        y_permuted, probs, plan = inputs
        ctx.plan = plan
        ctx.probs_dtype = None if probs is None else probs.dtype
        ctx.save_for_backward(y_permuted if probs is not None else None, probs)

    vmap = _no_vmap("combine")

    @staticmethod
    @_once
    def backward(ctx, grad_y):
        grad_y, y_p, probs = _bwd_plain("combine", grad_y.contiguous(), *ctx.saved_tensors)
        gyp, gp = _perm.combine_backward(grad_y, ctx.plan, y_p, probs)
        return gyp, (_as_dtype(gp, ctx.probs_dtype) if probs is not None else None), None


_combine_apply = _c_apply(_CombineFn)


def combine(y_permuted: Tensor, plan: TorchPlan, probs: Optional[Tensor] = None) -> Tensor:
    """Differentiable :func:`moe_rt.permutation.combine`: ``y[t] = sum_k w[t,k] * y_permuted[dst_row[t,k]]``
    (fp32 accumulation). Gradients flow to ``y_permuted`` and ``probs``."""
    _tensor(y_permuted, "y_permuted")
    _tensor(probs, "probs", True)
    if _eager():
        p = _plan_of(plan)
        if _functorch_active():
            return _CombineFn.apply(y_permuted, probs, p)
        if _needs_grad(y_permuted, probs):
            if _unwrap_dead is None:
                return _CombineFn.apply(y_permuted, probs, p)
            return _combine_apply(_unwrap_dead(y_permuted), None if probs is None else _unwrap_dead(probs), p)
        return _perm.combine(y_permuted, p, probs)
    return _combine_op(y_permuted, *_plan_args(plan), probs)


# -- router --------------------------------------------------------------------------------------------

def _opt(v: int):
    return None if v < 0 else v


@torch.library.custom_op("moe_rt::topk_with_score", mutates_args=())
def _topk_op(logits: Tensor, topk: int, score_function: str, use_pre_softmax: bool, num_groups: int,
             group_topk: int, scaling_factor: float, expert_bias: Optional[Tensor], routing_map_format: str,
             index_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(_rt.topk_with_score(
        logits, topk, score_function=score_function, use_pre_softmax=use_pre_softmax,
        num_groups=_opt(num_groups), group_topk=_opt(group_topk), scaling_factor=scaling_factor,
        expert_bias=expert_bias, routing_map_format=routing_map_format, topk_indices_dtype=index_dtype))


def _routing_like(logits: Tensor, topk: int, routing_map_format: str, index_dtype) -> Tensor:
    """An empty routing output of the right shape and dtype (the fake implementation's)."""
    lead = tuple(logits.shape[:-1])
    if index_dtype is not None:
        return logits.new_empty(lead + (topk,), dtype=index_dtype)
    if routing_map_format == "bitmap_u8":
        return logits.new_empty(lead + (_rt.bitmap_bytes(logits.shape[-1]),), dtype=torch.uint8)
    return torch.empty_like(logits, dtype=torch.bool)


@_topk_op.register_fake
def _(logits, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor, expert_bias,
      routing_map_format, index_dtype):
    return (torch.empty_like(logits), _routing_like(logits, topk, routing_map_format, index_dtype),
            torch.empty_like(logits, dtype=torch.float32))


@torch.library.custom_op("moe_rt::topk_with_score_backward", mutates_args=())
def _topk_bwd_op(grad_probs: Tensor, routing_map: Tensor, intermediate: Tensor, topk: int, score_function: str,
                 use_pre_softmax: bool, scaling_factor: float, routing_map_format: str, by_indices: bool) -> Tensor:
    if by_indices:
        return _rt.topk_with_score_backward(grad_probs.contiguous(), None, intermediate, topk,
                                            score_function=score_function, use_pre_softmax=use_pre_softmax,
                                            scaling_factor=scaling_factor, topk_indices=routing_map)
    return _rt.topk_with_score_backward(grad_probs.contiguous(), routing_map, intermediate, topk,
                                        score_function=score_function, use_pre_softmax=use_pre_softmax,
                                        scaling_factor=scaling_factor, routing_map_format=routing_map_format)


@_topk_bwd_op.register_fake
def _(grad_probs, routing_map, intermediate, topk, score_function, use_pre_softmax, scaling_factor,
      routing_map_format, by_indices):
    return torch.empty_like(grad_probs)


def _topk_setup(ctx, inputs, output):
    _, topk, score_function, use_pre_softmax, _, _, scaling_factor, _, routing_map_format, index_dtype = inputs
    ctx.args = (topk, score_function, use_pre_softmax, scaling_factor, routing_map_format, index_dtype is not None)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(output[1], output[2])


def _topk_bwd(ctx, grad_probs, _grad_map, _grad_inter):
    routing_map, inter = ctx.saved_tensors
    g = _topk_bwd_op(grad_probs, routing_map, inter, *ctx.args)
    return (g,) + (None,) * 9


_topk_op.register_autograd(_topk_bwd, setup_context=_topk_setup)


# the forward's keywords that its backward takes too, with moe_rt's defaults (the backward's keywords when
# the forward got none: one shared dict, never changed)
_TOPK_BWD_KW = (("score_function", "softmax"), ("use_pre_softmax", False), ("scaling_factor", None),
                ("routing_map_format", "bytemap"))
_TOPK_BWD_DEFAULT = dict(_TOPK_BWD_KW)


class _TopkFn(torch.autograd.Function):
    """Eager top-k: forward and backward straight to moe_rt. ``buf`` (a 4th input, optional): the caller's
    ``topk_indices`` buffer, written in place and marked dirty (the routing output is that tensor)."""

    @staticmethod
    def forward(logits, topk, kw, buf=None):
        if buf is None:
            return _rt.topk_with_score(logits, topk, **kw)
        return _rt.topk_with_score(logits, topk, topk_indices=buf, **kw)

    @staticmethod
    def setup_context(ctx, inputs, output):
        topk, kw = inputs[1], inputs[2]
        _, routing_map, inter = output
        ctx.set_materialize_grads(False)  # the map and the intermediate never get a gradient
        buf = inputs[3] if len(inputs) > 3 else None
        by_indices = buf is not None or (kw is not None and kw.get("topk_indices_dtype") is not None)
        ctx.args = (topk, {k: kw.get(k, d) for k, d in _TOPK_BWD_KW} if kw else _TOPK_BWD_DEFAULT, by_indices,
                    len(inputs))
        if buf is not None:
            ctx.mark_dirty(buf)
        ctx.mark_non_differentiable(routing_map, inter)
        ctx.save_for_backward(routing_map, inter)

    vmap = _no_vmap("topk_with_score")

    @staticmethod
    @_once
    def backward(ctx, grad_probs, _grad_map, _grad_inter):
        topk, bkw, by_indices, n_in = ctx.args
        if grad_probs is None:
            return (None,) * n_in
        grad_probs, routing, inter = _bwd_plain("topk_with_score", grad_probs.contiguous(), *ctx.saved_tensors)
        if by_indices:
            g = _rt.topk_with_score_backward(grad_probs, None, inter, topk, topk_indices=routing, **bkw)
        else:
            g = _rt.topk_with_score_backward(grad_probs, routing, inter, topk, **bkw)
        return (g,) + (None,) * (n_in - 1)


_topk_apply = _c_apply(_TopkFn)


def topk_with_score(logits: Tensor, topk: int, *, score_function: str = "softmax", use_pre_softmax: bool = False,
                    num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                    scaling_factor: Optional[float] = None, expert_bias: Optional[Tensor] = None,
                    routing_map_format: str = "bytemap", topk_indices: Optional[Tensor] = None,
                    topk_indices_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """Differentiable :func:`moe_rt.router.topk_with_score`: returns ``(probs [T,E] logits dtype,
    routing_map [T,E] bool)``; the gradient flows to ``logits`` (the expert bias gets none).

    ``routing_map_format="bitmap_u8"`` returns the bit-packed map (uint8 ``[T, ceil(E/8)]``) instead;
    ``topk_indices`` (an int16/int32/int64 ``[T, K]`` buffer, written in place and returned as the routing
    output) or ``topk_indices_dtype`` (a torch integer dtype) return the dense indices, ascending expert id
    per row; the backward then runs from the indices. Under ``torch.compile`` a buffer is filled by a copy
    from the op's output."""
    _tensor(logits, "logits")
    _tensor(expert_bias, "expert_bias", True)
    if topk_indices is not None or topk_indices_dtype is not None or (
            type(routing_map_format) is not str or routing_map_format != "bytemap"):
        return _topk_formats(logits, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor,
                             expert_bias, routing_map_format, topk_indices, topk_indices_dtype)
    if _eager():
        # only the keywords that differ from moe_rt's defaults: less to pass, and a shorter signature to key
        # the op's replay on
        kw = {}
        if type(score_function) is not str or score_function != "softmax":  # the op judges anything else
            kw["score_function"] = score_function
        if use_pre_softmax is not False:
            kw["use_pre_softmax"] = use_pre_softmax
        if num_groups is not None:
            kw["num_groups"] = num_groups
        if group_topk is not None:
            kw["group_topk"] = group_topk
        if scaling_factor is not None:
            kw["scaling_factor"] = scaling_factor
        if expert_bias is not None:
            kw["expert_bias"] = expert_bias
        if _functorch_active() or (_unwrap_dead is None and _needs_grad(logits)):
            probs, routing_map, _ = _TopkFn.apply(logits, topk, kw)
            return probs, routing_map
        if _needs_grad(logits):
            probs, routing_map, _ = _topk_apply(_unwrap_dead(logits), topk, kw)
            return probs, routing_map
        probs, routing_map, _ = _rt.topk_with_score(logits, topk, **kw)
        return probs, routing_map
    probs, routing_map, _ = _topk_op(logits, int(topk), str(score_function), bool(use_pre_softmax),
                                     -1 if num_groups is None else int(num_groups),
                                     -1 if group_topk is None else int(group_topk),
                                     1.0 if scaling_factor is None else float(scaling_factor), expert_bias,
                                     "bytemap", None)
    return probs, routing_map


def _topk_formats(logits, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor,
                  expert_bias, routing_map_format, topk_indices, topk_indices_dtype):
    """:func:`topk_with_score` with a bitmap or index routing output."""
    _tensor(topk_indices, "topk_indices", True)
    _rt.check_topk_outputs(logits, topk, routing_map_format, topk_indices, topk_indices_dtype)
    kw = dict(score_function=score_function, use_pre_softmax=use_pre_softmax, num_groups=num_groups,
              group_topk=group_topk, scaling_factor=scaling_factor, expert_bias=expert_bias,
              routing_map_format=routing_map_format)
    if _eager():
        if topk_indices is not None:
            probs, idx, _ = _TopkFn.apply(logits, topk, kw, topk_indices)
            return probs, idx
        if topk_indices_dtype is not None:
            kw["topk_indices_dtype"] = topk_indices_dtype
        probs, routing, _ = _TopkFn.apply(logits, topk, kw)
        return probs, routing
    if topk_indices is not None:
        index_dtype = topk_indices.dtype
    elif topk_indices_dtype is not None:
        index_dtype = _torch_index_dtype(topk_indices_dtype)
    else:
        index_dtype = None
    probs, routing, _ = _topk_op(logits, int(topk), str(score_function), bool(use_pre_softmax),
                                 -1 if num_groups is None else int(num_groups),
                                 -1 if group_topk is None else int(group_topk),
                                 1.0 if scaling_factor is None else float(scaling_factor), expert_bias,
                                 routing_map_format, index_dtype)
    if topk_indices is not None:
        topk_indices.copy_(routing)
        return probs, topk_indices
    return probs, routing


def _torch_index_dtype(dtype) -> torch.dtype:
    return getattr(torch, _rt.parse_index_dtype(dtype).name)


@torch.library.custom_op("moe_rt::scores_for_aux_loss", mutates_args=())
def _scores_op(logits: Tensor, topk: int, score_function: str,
               routing_map_format: str) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(_rt.scores_for_aux_loss(logits, topk, score_function, routing_map_format=routing_map_format))


@_scores_op.register_fake
def _(logits, topk, score_function, routing_map_format):
    return (torch.empty_like(logits, dtype=torch.float32), _routing_like(logits, topk, routing_map_format, None),
            torch.empty_like(logits, dtype=torch.float32))


@torch.library.custom_op("moe_rt::scores_for_aux_loss_backward", mutates_args=())
def _scores_bwd_op(grad_scores: Tensor, intermediate: Tensor, topk: int, score_function: str,
                   logits_like: Tensor) -> Tensor:
    from moe_rt import _arrays as _a

    dtype = _a.Call({"l": logits_like})["l"].dtype
    return _rt.scores_for_aux_loss_backward(grad_scores.contiguous(), intermediate, topk, score_function,
                                            dtype=dtype)


@_scores_bwd_op.register_fake
def _(grad_scores, intermediate, topk, score_function, logits_like):
    return torch.empty_like(grad_scores, dtype=logits_like.dtype)


def _scores_setup(ctx, inputs, output):
    logits, topk, score_function, _ = inputs
    ctx.args = (topk, score_function)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(output[2], logits.new_empty((0,)))


def _scores_bwd(ctx, grad_scores, _g_map, _g_inter):
    inter, like = ctx.saved_tensors
    return _scores_bwd_op(grad_scores.float(), inter, *ctx.args, like), None, None, None


_scores_op.register_autograd(_scores_bwd, setup_context=_scores_setup)


class _ScoresFn(torch.autograd.Function):
    """Eager aux-loss scores: forward and backward straight to moe_rt."""

    @staticmethod
    def forward(logits, topk, score_function, routing_map_format="bytemap"):
        return _rt.scores_for_aux_loss(logits, topk, score_function, routing_map_format=routing_map_format)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, topk, score_function = inputs[:3]
        _, routing_map, inter = output
        ctx.set_materialize_grads(False)  # the map and the intermediate never get a gradient
        ctx.args = (topk, score_function, logits.dtype)
        ctx.mark_non_differentiable(routing_map, inter)
        ctx.save_for_backward(inter)

    vmap = _no_vmap("scores_for_aux_loss")

    @staticmethod
    @_once
    def backward(ctx, grad_scores, _g_map, _g_inter):
        if grad_scores is None:
            return None, None, None
        grad_scores, inter = _bwd_plain("scores_for_aux_loss", grad_scores.float().contiguous(),
                                        *ctx.saved_tensors)
        topk, score_function, dtype = ctx.args
        g = _rt.scores_for_aux_loss_backward(grad_scores, inter, topk, score_function, dtype=dtype)
        return g, None, None, None


_scores_apply = _c_apply(_ScoresFn)


def scores_for_aux_loss(logits: Tensor, topk: int, score_function: str, *,
                        routing_map_format: str = "bytemap") -> tuple[Tensor, Tensor]:
    """Differentiable :func:`moe_rt.router.scores_for_aux_loss`: ``(scores [T,E] fp32, routing_map [T,E]
    bool)``; the gradient flows to ``logits``. ``routing_map_format="bitmap_u8"``: the map bit-packed (uint8
    ``[T, ceil(E/8)]``)."""
    _tensor(logits, "logits")
    if type(routing_map_format) is not str or routing_map_format != "bytemap":
        _rt.check_map_format(routing_map_format)
        if _eager():
            scores, routing_map, _ = _ScoresFn.apply(logits, topk, score_function, routing_map_format)
            return scores, routing_map
        scores, routing_map, _ = _scores_op(logits, int(topk), str(score_function), routing_map_format)
        return scores, routing_map
    if _eager():
        if _functorch_active() or (_unwrap_dead is None and _needs_grad(logits)):
            scores, routing_map, _ = _ScoresFn.apply(logits, topk, score_function)
            return scores, routing_map
        if _needs_grad(logits):
            scores, routing_map, _ = _scores_apply(_unwrap_dead(logits), topk, score_function)
            return scores, routing_map
        scores, routing_map, _ = _rt.scores_for_aux_loss(logits, topk, score_function)
        return scores, routing_map
    scores, routing_map, _ = _scores_op(logits, int(topk), str(score_function), "bytemap")
    return scores, routing_map


# -- Quantile Balancing ----------------------------------------------------------------------------------

@torch.library.custom_op("moe_rt::topk_with_score_qb", mutates_args=("qb_histogram",))
def _qb_op(logits: Tensor, expert_bias: Tensor, qb_histogram: Tensor, qb_bin_bounds: Tensor, topk: int,
           qb_histogram_mode: str, scaling_factor: float, bounds_validated: bool) -> tuple[Tensor, Tensor, Tensor]:
    probs, routing_map, inter, _ = _rt.topk_with_score_qb(
        logits, topk, expert_bias=expert_bias, qb_histogram=qb_histogram, qb_bin_bounds=qb_bin_bounds,
        qb_histogram_mode=qb_histogram_mode, scaling_factor=scaling_factor, bounds_validated=bounds_validated)
    return probs, routing_map, inter


@_qb_op.register_fake
def _(logits, expert_bias, qb_histogram, qb_bin_bounds, topk, qb_histogram_mode, scaling_factor, bounds_validated):
    return (torch.empty_like(logits), torch.empty_like(logits, dtype=torch.bool),
            torch.empty_like(logits, dtype=torch.float32))


class _QbFn(torch.autograd.Function):
    """Top-k with QB histograms: the core op eagerly, the mutating custom op (histogram in place) under
    torch.compile; the backward is the sigmoid top-k backward over the k routes (no gradient for the bias,
    histogram or bounds)."""

    @staticmethod
    def forward(logits, expert_bias, hist, bounds, topk, mode, scale, validated):
        if _eager():
            return _rt.topk_with_score_qb(logits, topk, expert_bias=expert_bias, qb_histogram=hist,
                                          qb_bin_bounds=bounds, qb_histogram_mode=mode, scaling_factor=scale,
                                          bounds_validated=validated)[:3]
        return _qb_op(logits, expert_bias, hist, bounds, topk, mode, scale, validated)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, routing_map, inter = output
        ctx.set_materialize_grads(False)
        ctx.args = (inputs[4], inputs[6])
        ctx.mark_non_differentiable(routing_map, inter)
        ctx.save_for_backward(routing_map, inter)

    vmap = _no_vmap("topk_with_score_qb")

    @staticmethod
    def backward(ctx, grad_probs, _grad_map, _grad_inter):
        if grad_probs is None:
            return (None,) * 8
        topk, scale = ctx.args
        routing_map, inter = ctx.saved_tensors
        if _eager():
            grad_probs, routing_map, inter = _bwd_plain("topk_with_score_qb", grad_probs.contiguous(), routing_map,
                                                        inter)
            g = _rt.topk_with_score_backward(grad_probs, routing_map, inter, topk, score_function="sigmoid",
                                             scaling_factor=scale)
        else:
            g = _topk_bwd_op(grad_probs, routing_map, inter, topk, "sigmoid", False, scale, "bytemap", False)
        return (g,) + (None,) * 7


def topk_with_score_qb(logits: Tensor, topk: int, *, expert_bias: Tensor, qb_histogram: Tensor,
                       qb_bin_bounds: Tensor, qb_histogram_mode: str = "fused_atomic",
                       scaling_factor: Optional[float] = None,
                       bounds_validated: bool = False) -> tuple[Tensor, Tensor]:
    """Differentiable :func:`moe_rt.router.topk_with_score_qb`: returns ``(probs [T,E] logits dtype,
    routing_map [T,E] bool)`` and accumulates ``qb_histogram`` ([E, B] int32) in place. The gradient flows
    to ``logits`` (the sigmoid backward over the k routes); the bias, histogram and bounds get none.
    ``bounds_validated=True`` skips the host read that checks the bounds' values (for CUDA graph capture
    after a checked call; ``moe_rt.te`` does that bookkeeping per tensor version)."""
    _tensor(logits, "logits")
    for t, name in ((expert_bias, "expert_bias"), (qb_histogram, "qb_histogram"), (qb_bin_bounds, "qb_bin_bounds")):
        _tensor(t, name)
    scale = 1.0 if scaling_factor is None else scaling_factor
    if _eager() and not _functorch_active() and not _needs_grad(logits):
        probs, routing_map, _, _ = _rt.topk_with_score_qb(
            logits, topk, expert_bias=expert_bias, qb_histogram=qb_histogram, qb_bin_bounds=qb_bin_bounds,
            qb_histogram_mode=qb_histogram_mode, scaling_factor=scaling_factor, bounds_validated=bounds_validated)
        return probs, routing_map
    if not _eager():
        topk, qb_histogram_mode, scale, bounds_validated = (int(topk), str(qb_histogram_mode), float(scale),
                                                             bool(bounds_validated))
    probs, routing_map, _ = _QbFn.apply(logits, expert_bias, qb_histogram, qb_bin_bounds, topk, qb_histogram_mode,
                                        scale, bounds_validated)
    return probs, routing_map


@torch.library.custom_op("moe_rt::aux_loss", mutates_args=())
def _aux_op(probs: Tensor, tokens_per_expert: Tensor, total_num_tokens: int, num_experts: int, topk: int,
            coeff: float) -> Tensor:
    return _rt.aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)


@_aux_op.register_fake
def _(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    return probs.new_empty(())


@torch.library.custom_op("moe_rt::aux_loss_backward", mutates_args=())
def _aux_bwd_op(grad: Tensor, num_rows: int, tokens_per_expert: Tensor, total_num_tokens: int, num_experts: int,
                topk: int, coeff: float) -> Tensor:
    return _rt.aux_loss_backward(grad.contiguous(), num_rows, tokens_per_expert, total_num_tokens,
                                 num_experts, topk, coeff).contiguous()


@_aux_bwd_op.register_fake
def _(grad, num_rows, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    return grad.new_empty((num_rows, tokens_per_expert.shape[0]))


def _aux_setup(ctx, inputs, output):
    probs, tpe, total, E, topk, coeff = inputs
    ctx.args = (total, E, topk, coeff)
    ctx.num_rows = probs.shape[0]
    ctx.probs_dtype = probs.dtype
    ctx.save_for_backward(tpe)


def _aux_bwd(ctx, grad):
    (tpe,) = ctx.saved_tensors
    g = _aux_bwd_op(grad, ctx.num_rows, tpe, *ctx.args)
    return (g.to(ctx.probs_dtype),) + (None,) * 5


_aux_op.register_autograd(_aux_bwd, setup_context=_aux_setup)


class _AuxFn(torch.autograd.Function):
    """Eager aux loss: forward and backward straight to moe_rt."""

    @staticmethod
    def forward(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
        return _rt.aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)

    @staticmethod
    def setup_context(ctx, inputs, output):
        probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff = inputs
        ctx.num_rows = probs.shape[0]
        ctx.probs_dtype = probs.dtype
        if isinstance(total_num_tokens, Tensor):  # the forward's value, whatever is written there later
            ctx.args = (num_experts, topk, coeff)
            ctx.save_for_backward(tokens_per_expert, total_num_tokens.clone())
        else:
            ctx.args = (total_num_tokens, num_experts, topk, coeff)
            ctx.save_for_backward(tokens_per_expert)

    vmap = _no_vmap("aux_loss")

    @staticmethod
    @_once
    def backward(ctx, grad):
        grad, tpe, *total = _bwd_plain("aux_loss", grad.contiguous(), *ctx.saved_tensors)
        g = _rt.aux_loss_backward(grad, ctx.num_rows, tpe, *total, *ctx.args)
        return (g.contiguous().to(ctx.probs_dtype),) + (None,) * 5


_aux_apply = _c_apply(_AuxFn)


def aux_loss(probs: Tensor, tokens_per_expert: Tensor, total_num_tokens, num_experts: int, topk: int,
             coeff: float) -> Tensor:
    """Differentiable :func:`moe_rt.router.aux_loss` (a 0-d tensor); the gradient flows to ``probs``.
    ``total_num_tokens``: an int, or a 0-d (or one-element) int32/int64 tensor on the probs' device, read
    on the device (no sync; CUDA-graph capturable): the forward keeps a device copy of it for the backward,
    so both use the same value."""
    _tensor(probs, "probs")
    _tensor(tokens_per_expert, "tokens_per_expert")
    if _eager():
        args = (tokens_per_expert, total_num_tokens, num_experts, topk, coeff)
        if _functorch_active():
            return _AuxFn.apply(probs, *args)
        if _needs_grad(probs):
            if _unwrap_dead is None:
                return _AuxFn.apply(probs, *args)
            return _aux_apply(_unwrap_dead(probs), *args)
        return _rt.aux_loss(probs, *args)
    if isinstance(total_num_tokens, Tensor):
        return _aux_loss_dev(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)
    return _aux_op(probs, tokens_per_expert, int(total_num_tokens), int(num_experts), int(topk), float(coeff))


@torch.library.custom_op("moe_rt::aux_loss_dev", mutates_args=())
def _aux_dev_op(probs: Tensor, tokens_per_expert: Tensor, total_num_tokens: Tensor, num_experts: int, topk: int,
                coeff: float) -> Tensor:
    return _rt.aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)


@_aux_dev_op.register_fake
def _(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    return probs.new_empty(())


@torch.library.custom_op("moe_rt::aux_loss_dev_backward", mutates_args=())
def _aux_dev_bwd_op(grad: Tensor, num_rows: int, tokens_per_expert: Tensor, total_num_tokens: Tensor,
                    num_experts: int, topk: int, coeff: float) -> Tensor:
    return _rt.aux_loss_backward(grad.contiguous(), num_rows, tokens_per_expert, total_num_tokens, num_experts,
                                 topk, coeff).contiguous()


@_aux_dev_bwd_op.register_fake
def _(grad, num_rows, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    return grad.new_empty((num_rows, tokens_per_expert.shape[0]))


def _aux_dev_setup(ctx, inputs, output):
    probs, tpe, total, E, topk, coeff = inputs
    ctx.args = (E, topk, coeff)
    ctx.num_rows = probs.shape[0]
    ctx.probs_dtype = probs.dtype
    ctx.save_for_backward(tpe, total.clone())  # the forward's value, whatever is written there later


def _aux_dev_bwd(ctx, grad):
    tpe, total = ctx.saved_tensors
    g = _aux_dev_bwd_op(grad, ctx.num_rows, tpe, total, *ctx.args)
    return (g.to(ctx.probs_dtype),) + (None,) * 5


_aux_dev_op.register_autograd(_aux_dev_bwd, setup_context=_aux_dev_setup)


def _aux_loss_dev(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    # under torch.compile (eager runs _AuxFn, which keeps the forward's value the same way)
    return _aux_dev_op(probs, tokens_per_expert, total_num_tokens, int(num_experts), int(topk), float(coeff))


# -- chunk sort ----------------------------------------------------------------------------------------

def _chunk_tensor(a, name: str, x: Tensor) -> Tensor:
    """split_sizes / sorted_indices as an int tensor on x's device (lists and NumPy arrays become int32)."""
    if isinstance(a, Tensor):
        if a.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name}: expected int32 or int64, got dtype {a.dtype}")
        return a if a.device == x.device else a.to(x.device)
    try:
        return torch.as_tensor(a, dtype=torch.int32, device=x.device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name}: expected a sequence of ints or an int tensor, got {type(a).__name__}") from e


@torch.library.custom_op("moe_rt::sort_chunks", mutates_args=())
def _sort_chunks_op(x: Tensor, split_sizes: Tensor, sorted_indices: Tensor,
                    probs: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    r = _perm.sort_chunks(x, split_sizes, sorted_indices, probs=probs)
    return (r[0], r[1]) if probs is not None else (r, _empty_probs(x))


@_sort_chunks_op.register_fake
def _(x, split_sizes, sorted_indices, probs):
    return torch.empty_like(x), x.new_empty((x.shape[0] if probs is not None else 0,), dtype=torch.float32)


@torch.library.custom_op("moe_rt::sort_chunks_backward", mutates_args=())
def _sort_chunks_bwd_op(grad_out: Tensor, split_sizes: Tensor, sorted_indices: Tensor,
                        grad_probs: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    r = _perm.sort_chunks_backward(grad_out.contiguous(), split_sizes, sorted_indices,
                                   grad_probs=None if grad_probs is None else grad_probs.contiguous())
    return (r[0], r[1]) if grad_probs is not None else (r, _empty_probs(grad_out))


@_sort_chunks_bwd_op.register_fake
def _(grad_out, split_sizes, sorted_indices, grad_probs):
    return (torch.empty_like(grad_out),
            grad_out.new_empty((grad_out.shape[0] if grad_probs is not None else 0,), dtype=torch.float32))


def _sort_chunks_setup(ctx, inputs, output):
    x, split_sizes, sorted_indices, probs = inputs
    ctx.probs_dtype = None if probs is None else probs.dtype
    ctx.save_for_backward(split_sizes, sorted_indices)


def _sort_chunks_bwd(ctx, grad_out, grad_po):
    split_sizes, sorted_indices = ctx.saved_tensors
    has_probs = ctx.probs_dtype is not None
    gx, gp = _sort_chunks_bwd_op(grad_out, split_sizes, sorted_indices, grad_po if has_probs else None)
    return gx, None, None, (gp.to(ctx.probs_dtype) if has_probs else None)


_sort_chunks_op.register_autograd(_sort_chunks_bwd, setup_context=_sort_chunks_setup)


class _SortChunksFn(torch.autograd.Function):
    """Eager chunk sort: forward and backward straight to moe_rt."""

    @staticmethod
    def forward(x, probs, split_sizes, sorted_indices):
        r = _perm.sort_chunks(x, split_sizes, sorted_indices, probs=probs)
        return (r[0], r[1]) if probs is not None else (r, None)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, probs, split_sizes, sorted_indices = inputs
        ctx.set_materialize_grads(False)  # no zero tensors made for outputs that get no gradient
        ctx.chunks = (split_sizes, sorted_indices)
        ctx.meta = (x.shape, x.dtype, None if probs is None else probs.dtype)

    vmap = _no_vmap("sort_chunks")

    @staticmethod
    @_once
    def backward(ctx, grad_out, grad_po):
        shape, dtype, pdt = ctx.meta
        gpo = grad_po if pdt is not None else None
        if grad_out is None and gpo is None:
            return None, None, None, None
        if grad_out is None:
            grad_out = torch.zeros(shape, dtype=dtype, device=gpo.device)
        grad_out, gpo = _bwd_plain("sort_chunks", grad_out.contiguous(), None if gpo is None else gpo.contiguous())
        chunks = [_plain(c, "sort_chunks") if isinstance(c, Tensor) else c for c in ctx.chunks]
        r = _perm.sort_chunks_backward(grad_out, *chunks, grad_probs=gpo)
        if gpo is None:
            return r, None, None, None
        return r[0], r[1].to(pdt), None, None


def sort_chunks(x: Tensor, split_sizes, sorted_indices, probs: Optional[Tensor] = None):
    """Differentiable :func:`moe_rt.permutation.sort_chunks` (eager and ``torch.compile``): the rows of
    ``x [N, ...]`` form chunks of sizes ``split_sizes`` put in the order ``sorted_indices`` (int tensors,
    or lists checked on the host). Returns ``out`` or, with ``probs [N]``, ``(out, probs_out [N] fp32)``;
    gradients flow to ``x`` and ``probs`` (the inverse reordering)."""
    _tensor(x, "x")
    _tensor(probs, "probs", True)
    if _eager():
        # host sizes (lists, NumPy, CPU tensors for CUDA x) are validated by the core op on the host
        s, o = (a.numpy() if isinstance(a, Tensor) and a.device != x.device and a.device.type == "cpu" else a
                for a in (split_sizes, sorted_indices))
        if _functorch_active() or _needs_grad(x, probs):  # torch.func.grad/vjp (vmap is refused) or autograd
            out, po = _SortChunksFn.apply(x, probs, s, o)
        else:
            r = _perm.sort_chunks(x, s, o, probs=probs)
            out, po = (r[0], r[1]) if probs is not None else (r, None)
        return out if probs is None else (out, po)
    s = _chunk_tensor(split_sizes, "split_sizes", x)
    o = _chunk_tensor(sorted_indices, "sorted_indices", x)
    out, po = _sort_chunks_op(x, s, o, probs)
    return out if probs is None else (out, po)


# -- FP8 quantization --------------------------------------------------------------------------------

class _Meta:
    """A tensor's shape and NumPy dtype, for the core ops' argument checks at trace time."""

    def __init__(self, t: Tensor, name: str):
        self.shape, self.ndim = tuple(t.shape), t.dim()
        dt = _arrays._torch_np_dtype(t.dtype)
        if dt is None:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported")
        self.dtype = dt


@torch.library.custom_op("moe_rt::quantize_fp8", mutates_args=())
def _quantize_fp8_op(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    return _fp8.quantize_fp8(x, block)


@_quantize_fp8_op.register_fake
def _(x, block):
    T, H, nb = _fp8.check_quantize_args(_Meta(x, "x"), block)
    return x.new_empty((T, H), dtype=torch.float8_e4m3fn), x.new_empty((T, nb), dtype=torch.float32)


@torch.library.custom_op("moe_rt::dequantize_fp8", mutates_args=())
def _dequantize_fp8_op(x_fp8: Tensor, scales: Tensor, dtype: torch.dtype, block: int) -> Tensor:
    return _fp8.dequantize_fp8(x_fp8, scales, dtype, block)


@_dequantize_fp8_op.register_fake
def _(x_fp8, scales, dtype, block):
    T, H, _, _ = _fp8.check_dequantize_args(_Meta(x_fp8, "x_fp8"), _Meta(scales, "scales"), dtype, block)
    return x_fp8.new_empty((T, H), dtype=dtype)


def quantize_fp8(x: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """:func:`moe_rt.fp8.quantize_fp8` for torch (eager and ``torch.compile``): ``x [T,H]`` fp32/bf16/fp16 ->
    ``(x_fp8 [T,H] torch.float8_e4m3fn, scales [T, ceil(H/block)] fp32)``. Not differentiable: the
    outputs carry no gradient (``x`` is read detached)."""
    _tensor(x, "x")
    x = x.detach()
    if _eager():
        return _fp8.quantize_fp8(x, block)
    return _quantize_fp8_op(x, block)


def dequantize_fp8(x_fp8: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16, block: int = 128) -> Tensor:
    """:func:`moe_rt.fp8.dequantize_fp8` for torch (eager and ``torch.compile``): ``y [T,H]`` in ``dtype``
    (torch.float32, float16 or bfloat16). Not differentiable (the inputs are read detached)."""
    _tensor(x_fp8, "x_fp8")
    _tensor(scales, "scales")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype (float32, float16 or bfloat16), got {dtype!r}")
    x_fp8, scales = x_fp8.detach(), scales.detach()
    if _eager():
        return _fp8.dequantize_fp8(x_fp8, scales, dtype, block)
    return _dequantize_fp8_op(x_fp8, scales, dtype, block)


# -- expert parallelism ------------------------------------------------------------------------------

from moe_rt._torch_ep import TorchEpHandle, ep_combine, ep_dispatch, ep_prepare  # noqa: E402
from moe_rt._torch_ep import TorchLLHandle, ll_combine, ll_dispatch  # noqa: E402

__all__ += ["TorchLLHandle", "ll_dispatch", "ll_combine"]
