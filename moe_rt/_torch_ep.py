"""PyTorch adapters for expert parallelism (re-exported by :mod:`moe_rt.torch`).

``ep_prepare`` returns a :class:`TorchEpHandle` (tensors and ints only); ``ep_dispatch`` and ``ep_combine``
are ``torch.library`` custom ops with autograd formulas that call :meth:`EpGroup.dispatch_bwd` and
:meth:`EpGroup.combine_bwd`. Every op is a collective: all ranks must call the same ops in the same order
(autograd runs the backward ops in the reverse order on every rank, which keeps them matched).

Under ``torch.compile`` use a capacity-mode group: its sizes are static, so dispatch and combine trace
without graph breaks. An exact-mode ``prepare`` reads counts on the host and cannot be traced.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from moe_rt import _arrays
from moe_rt import _ep_adapt as _A
from moe_rt import ep as _ep

__all__ = ["TorchEpHandle", "ep_prepare", "ep_dispatch", "ep_combine"]


class TorchEpHandle(NamedTuple):
    """An EP plan as tensors: ``buffer`` (uint8, the :class:`moe_rt.Handle` buffer, on the GPU),
    ``host_meta`` (int32 CPU copy of the meta region; empty in capacity mode), ``tokens_per_expert``
    (int32 ``[L]``, rows per local expert, padded when ``align_size > 1``), and the static ``group_id``,
    ``num_tokens`` (T), ``topk`` (K), ``num_rows`` (N, the rows of ``recv_x``)."""
    buffer: Tensor
    host_meta: Tensor
    tokens_per_expert: Tensor
    group_id: int
    num_tokens: int
    topk: int
    num_rows: int


def _handle(group_id, buffer, host_meta, T, K, *, copy=False):
    group = _A.lookup(group_id)
    with _arrays.Call({"buffer": buffer}) as call:
        buf = call["buffer"]
    return group, _A.handle_from(group, buf, T, K, host_meta.numpy(), copy=copy)


def _empty_f32(like: Tensor) -> Tensor:
    return like.new_empty((0,), dtype=torch.float32)


# -- prepare ---------------------------------------------------------------------------------------------

@torch.library.custom_op("moe_rt::ep_prepare", mutates_args=())
def _prepare_op(topk_idx: Tensor, group_id: int) -> tuple[Tensor, Tensor, Tensor]:
    group = _A.lookup(group_id)
    h = group.prepare(topk_idx)
    buf = _arrays.export(h.buffer, "torch")
    meta = torch.from_numpy(_A.host_meta_of(h))
    tpe = _arrays.export(h.view("tokens_per_expert").copy(), "torch")
    return buf, meta, tpe


@_prepare_op.register_fake
def _(topk_idx, group_id):
    group = _A.lookup(group_id)
    if group.mode != "capacity":
        raise ValueError("ep_prepare: an exact-mode group reads counts on the host and cannot be traced; use "
                         "mode='capacity' under torch.compile")
    T, K = topk_idx.shape
    _, _, total = _A.sizes(group, int(T), int(K))
    return (topk_idx.new_empty((total,), dtype=torch.uint8), torch.empty((0,), dtype=torch.int32),
            topk_idx.new_empty((group.num_local_experts,), dtype=torch.int32))


def ep_prepare(group, topk_idx: Tensor) -> TorchEpHandle:
    """:meth:`moe_rt.EpGroup.prepare` for torch (a collective; not differentiable). ``topk_idx [T,K]``
    int32/int64 on the group's GPU (-1 = no expert)."""
    gid = _A.register(group)
    _tensor(topk_idx, "topk_idx")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx: expected a 2-D tensor, got {getattr(topk_idx, 'shape', type(topk_idx))}")
    T, K = int(topk_idx.shape[0]), int(topk_idx.shape[1])
    buf, meta, tpe = _prepare_op(topk_idx, gid)
    _, N = _A.rows_of(group, T, K, None if group.mode == "capacity" else meta.numpy())
    return TorchEpHandle(buf, meta, tpe, gid, T, K, N)


def _tensor(t, name: str, optional: bool = False) -> None:
    if not isinstance(t, Tensor) and not (optional and t is None):
        raise TypeError(f"{name}: expected a torch.Tensor{' or None' if optional else ''}, got {type(t).__name__}")


def _check(handle):
    if not isinstance(handle, TorchEpHandle):
        raise TypeError(f"handle: expected a TorchEpHandle from moe_rt.torch.ep_prepare, got "
                        f"{type(handle).__name__}")
    return handle


# -- dispatch --------------------------------------------------------------------------------------------

@torch.library.custom_op("moe_rt::ep_dispatch", mutates_args=())
def _dispatch_op(x: Tensor, topk_weights: Optional[Tensor], buffer: Tensor, host_meta: Tensor, group_id: int,
                 topk: int, num_rows: int, fp8: bool = False, zero_empty_slots: bool = True) -> tuple[Tensor, Tensor]:
    # dispatch stores the received weights in the handle: run it on a copy so the input stays unchanged
    group, h = _handle(group_id, buffer, host_meta, x.shape[0], topk, copy=topk_weights is not None)
    # fp8: FP8 on the wire, rows dequantized on the receiving side (the same autograd: straight-through)
    rx, rw, _ = group.dispatch(h, x.contiguous(), topk_weights, fp8=fp8, dequantize=fp8,
                               zero_empty_slots=zero_empty_slots)
    return rx, (_empty_f32(x) if rw is None else rw)


@_dispatch_op.register_fake
def _(x, topk_weights, buffer, host_meta, group_id, topk, num_rows, fp8=False, zero_empty_slots=True):
    return (x.new_empty((num_rows, x.shape[1])),
            x.new_empty((num_rows if topk_weights is not None else 0,), dtype=torch.float32))


@torch.library.custom_op("moe_rt::ep_dispatch_backward", mutates_args=())
def _dispatch_bwd_op(grad_recv_x: Tensor, grad_recv_w: Optional[Tensor], buffer: Tensor, host_meta: Tensor,
                     group_id: int, num_tokens: int, topk: int) -> tuple[Tensor, Tensor]:
    group, h = _handle(group_id, buffer, host_meta, num_tokens, topk)
    gx, gw = group.dispatch_bwd(h, grad_recv_x.contiguous(), grad_recv_w)
    return gx, (_empty_f32(grad_recv_x) if gw is None else gw)


@_dispatch_bwd_op.register_fake
def _(grad_recv_x, grad_recv_w, buffer, host_meta, group_id, num_tokens, topk):
    return (grad_recv_x.new_empty((num_tokens, grad_recv_x.shape[1])),
            grad_recv_x.new_empty((num_tokens, topk) if grad_recv_w is not None else (0,), dtype=torch.float32))


def _dispatch_setup(ctx, inputs, output):
    x, w, buffer, host_meta, gid, topk = inputs[:6]
    ctx.args = (gid, x.shape[0], topk)
    ctx.w_dtype = None if w is None else w.dtype
    ctx.save_for_backward(buffer, host_meta)


def _dispatch_bwd(ctx, grad_rx, grad_rw):
    buffer, host_meta = ctx.saved_tensors
    gid, T, K = ctx.args
    has_w = ctx.w_dtype is not None
    if has_w and grad_rw is None:
        grad_rw = torch.zeros((grad_rx.shape[0],), dtype=torch.float32, device=grad_rx.device)
    gx, gw = _dispatch_bwd_op(grad_rx, grad_rw if has_w else None, buffer, host_meta, gid, T, K)
    return gx, (gw.to(ctx.w_dtype) if has_w else None), None, None, None, None, None, None, None


_dispatch_op.register_autograd(_dispatch_bwd, setup_context=_dispatch_setup)


def _grad_dtype(group, x_dtype):
    """The float dtype of an FP8 dispatch's gradient path: x's for a float x, else the group's (bfloat16)."""
    if x_dtype.is_floating_point and x_dtype.itemsize > 1:
        return x_dtype
    return _arrays._torch_dtype_of(group.dtype or _arrays.BFLOAT16)


@torch.library.custom_op("moe_rt::ep_dispatch_fp8", mutates_args=())
def _dispatch_fp8_op(x: Tensor, scales: Optional[Tensor], topk_weights: Optional[Tensor], buffer: Tensor,
                     host_meta: Tensor, group_id: int, topk: int, num_rows: int, dequantize: bool,
                     zero_empty_slots: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    group, h = _handle(group_id, buffer, host_meta, x.shape[0], topk, copy=topk_weights is not None)
    xin = x.contiguous() if scales is None else (x.contiguous(), scales.contiguous())
    out = group.dispatch(h, xin, topk_weights, fp8=True, dequantize=dequantize, zero_empty_slots=zero_empty_slots)
    if dequantize:
        (ry, rw, _), rs = out, _empty_f32(x)
    else:
        ry, rs, rw, _ = out
    return ry, rs, (_empty_f32(x) if rw is None else rw)


@_dispatch_fp8_op.register_fake
def _(x, scales, topk_weights, buffer, host_meta, group_id, topk, num_rows, dequantize, zero_empty_slots=True):
    group = _A.lookup(group_id)
    H = x.shape[1]
    if dequantize:
        rows, rs = x.new_empty((num_rows, H), dtype=_grad_dtype(group, x.dtype)), _empty_f32(x)
    else:
        rows = x.new_empty((num_rows, H), dtype=torch.float8_e4m3fn if scales is None else x.dtype)
        rs = x.new_empty((num_rows, -(-H // _ep.FP8_BLOCK)), dtype=torch.float32)
    return rows, rs, x.new_empty((num_rows if topk_weights is not None else 0,), dtype=torch.float32)


def _dispatch_fp8_setup(ctx, inputs, output):
    x, _, w, buffer, host_meta, gid, topk = inputs[:7]
    ctx.args = (gid, x.shape[0], topk, _grad_dtype(_A.lookup(gid), x.dtype))
    ctx.w_dtype = None if w is None else w.dtype
    ctx.mark_non_differentiable(output[0], output[1])
    ctx.save_for_backward(buffer, host_meta)


def _dispatch_fp8_bwd(ctx, _g_rows, _g_scales, grad_rw):
    """Only the received weights carry a gradient (to topk_weights): dispatch_bwd of zero rows."""
    buffer, host_meta = ctx.saved_tensors
    gid, T, K, gdt = ctx.args
    gw = None
    if ctx.w_dtype is not None and grad_rw is not None:
        zeros = grad_rw.new_zeros((grad_rw.shape[0], _A.lookup(gid).hidden), dtype=gdt)
        gw = _dispatch_bwd_op(zeros, grad_rw, buffer, host_meta, gid, T, K)[1].to(ctx.w_dtype)
    return None, None, gw, None, None, None, None, None, None, None


_dispatch_fp8_op.register_autograd(_dispatch_fp8_bwd, setup_context=_dispatch_fp8_setup)


def ep_dispatch(handle: TorchEpHandle, x, topk_weights: Optional[Tensor] = None, *, fp8: bool = False,
                dequantize: bool = False, zero_empty_slots: bool = True):
    """Differentiable :meth:`moe_rt.EpGroup.dispatch` (a collective): ``x [T,H]`` goes once to each rank
    holding one of its experts and lands there in expert-major order. ``handle.tokens_per_expert`` gives
    the rows per local expert.

    - ``fp8=False``: returns ``(recv_x [N,H], recv_weights [N] fp32 or None)``; gradients flow to ``x`` and
      ``topk_weights``.
    - ``fp8=True``: FP8 on the wire (``H + 4*ceil(H/128)`` bytes a row; docs/ep.md). ``x`` is a float
      tensor (quantized on the sending side) or a pre-quantized pair ``(x_fp8 [T,H] float8_e4m3fn or
      uint8, scales [T, ceil(H/128)] fp32)``. Returns ``(recv_x_fp8 [N,H] torch.float8_e4m3fn (uint8 for
      a uint8 pair), recv_scales [N, ceil(H/128)] fp32, recv_weights [N] fp32 or None)``, for an FP8
      grouped GEMM. The FP8 rows and scales carry **no gradient** (``x`` gets none from this call; for
      training, pass ``dequantize=True``, or take the received rows' bf16 gradient to
      :meth:`moe_rt.EpGroup.dispatch_bwd` yourself); ``recv_weights`` stays differentiable (its backward
      runs a dispatch_bwd of zero rows).
    - ``fp8=True, dequantize=True``: returns ``(recv_x [N,H], recv_weights)`` dequantized on the receiving
      side, in x's dtype (a pair: the group's dtype, bfloat16 without one). For a float ``x`` the gradient
      is **straight-through**: the quantization counts as the identity in the backward, so ``x`` gets the
      bf16 ``dispatch_bwd`` of ``recv_x``'s gradient (the usual FP8-training convention; gradients never
      travel as FP8). A pair gets no gradient (FP8 inputs); ``recv_weights`` as above.
    - ``zero_empty_slots``: as in :meth:`moe_rt.EpGroup.dispatch`: True (the default) writes zero rows (zero
      codes and scales) past each local expert's filled rows; False leaves them unspecified (not written:
      they hold whatever the caching allocator's memory held, NaN bit patterns included). Keep the default
      when an expert runs over every row and its backward sums over rows (a weight gradient of ``0 * NaN``
      is NaN), or mask those rows first.
    """
    _check(handle)
    _A.check_fp8_flags(fp8, dequantize)
    _A.check_bool(zero_empty_slots, "zero_empty_slots")
    _tensor(topk_weights, "topk_weights", True)
    pair = isinstance(x, (tuple, list))
    if pair:
        _A.check_pair_arity(x, fp8)
        _tensor(x[0], "x_fp8")
        _tensor(x[1], "scales")
    else:
        _tensor(x, "x")
    args = (handle.buffer, handle.host_meta, handle.group_id, handle.topk, handle.num_rows)
    if not fp8 or (dequantize and not pair):
        rx, rw = _dispatch_op(x, topk_weights, *args, fp8, bool(zero_empty_slots))
        return rx, (rw if topk_weights is not None else None)
    x0, sc = (x[0].detach(), x[1].detach()) if pair else (x.detach(), None)
    ry, rs, rw = _dispatch_fp8_op(x0, sc, topk_weights, *args, dequantize, bool(zero_empty_slots))
    rw = rw if topk_weights is not None else None
    return (ry, rw) if dequantize else (ry, rs, rw)


# -- combine ---------------------------------------------------------------------------------------------

def _weighted(call_w, h):
    with _arrays.Call({"w": call_w}) as call:
        return _A.with_weights(h, call["w"], call.xp)


@torch.library.custom_op("moe_rt::ep_combine", mutates_args=())
def _combine_op(y: Tensor, recv_weights: Optional[Tensor], buffer: Tensor, host_meta: Tensor, group_id: int,
                num_tokens: int, topk: int) -> Tensor:
    group, h = _handle(group_id, buffer, host_meta, num_tokens, topk)
    if recv_weights is not None:
        h = _weighted(recv_weights, h)
    return group.combine(h, y.contiguous(), weighted=recv_weights is not None)


@_combine_op.register_fake
def _(y, recv_weights, buffer, host_meta, group_id, num_tokens, topk):
    return y.new_empty((num_tokens, y.shape[1]))


@torch.library.custom_op("moe_rt::ep_combine_backward", mutates_args=())
def _combine_bwd_op(grad_out: Tensor, y: Optional[Tensor], recv_weights: Optional[Tensor], buffer: Tensor,
                    host_meta: Tensor, group_id: int, num_tokens: int, topk: int,
                    num_rows: int) -> tuple[Tensor, Tensor]:
    group, h = _handle(group_id, buffer, host_meta, num_tokens, topk)
    weighted = recv_weights is not None
    if weighted:
        h = _weighted(recv_weights, h)
    gy, gw = group.combine_bwd(h, grad_out.contiguous(), y if weighted else None, weighted=weighted)
    return gy, (_empty_f32(grad_out) if gw is None else gw)


@_combine_bwd_op.register_fake
def _(grad_out, y, recv_weights, buffer, host_meta, group_id, num_tokens, topk, num_rows):
    return (grad_out.new_empty((num_rows, grad_out.shape[1])),
            grad_out.new_empty((num_rows if recv_weights is not None else 0,), dtype=torch.float32))


def _combine_setup(ctx, inputs, output):
    y, w, buffer, host_meta, gid, T, K = inputs
    ctx.args = (gid, T, K, y.shape[0])
    ctx.w_dtype = None if w is None else w.dtype
    ctx.save_for_backward(y if w is not None else None, w, buffer, host_meta)


def _combine_bwd(ctx, grad_out):
    y, w, buffer, host_meta = ctx.saved_tensors
    gid, T, K, N = ctx.args
    gy, gw = _combine_bwd_op(grad_out, y, w, buffer, host_meta, gid, T, K, N)
    return gy, (None if w is None else gw.to(ctx.w_dtype)), None, None, None, None, None


_combine_op.register_autograd(_combine_bwd, setup_context=_combine_setup)


def ep_combine(handle: TorchEpHandle, y: Tensor, recv_weights: Optional[Tensor] = None) -> Tensor:
    """Differentiable :meth:`moe_rt.EpGroup.combine` (a collective): ``y [N,H]`` (expert outputs in
    ``recv_x``'s layout) back to each token's rank, ``out[t] = sum over its slots of w * y`` (fp32
    accumulation, fixed order). ``recv_weights [N]`` (e.g. dispatch's ``recv_weights``) weights the rows;
    None sums them unweighted. Gradients flow to ``y`` and ``recv_weights``."""
    _check(handle)
    _tensor(y, "y")
    _tensor(recv_weights, "recv_weights", True)
    return _combine_op(y, recv_weights, handle.buffer, handle.host_meta, handle.group_id, handle.num_tokens,
                       handle.topk)


# -- the low-latency mode (moe_rt.LowLatencyGroup) ---------------------------------------------------------
#
# ll_dispatch / ll_combine are torch.autograd.Function calls, not torch.library custom ops: recv_x (and the
# gradient combine's backward gives the expert outputs) is a view of the group's receive buffer, reused by
# every dispatch-direction op, and each such op bumps the version counter of the one tensor over that
# buffer. A custom op may neither return an alias of memory it does not take as an input nor mutate hidden
# state, so these calls are eager only: under torch.compile they run outside the graph
# (torch.compiler.disable). The low-latency mode is for decode and small batches, where CUDA graphs of the
# group's ops (LowLatencyGroup's notes) serve better than compilation.

import weakref  # noqa: E402

from torch.autograd.graph import increment_version  # noqa: E402

__all__ += ["TorchLLHandle", "ll_dispatch", "ll_combine"]


class _LLBuffers:
    """The torch tensors over a group's receive buffers, one per buffer set (``num_buffers``). On CPU they
    are buffers the reference's results are copied into, the sets taking turns as the GPU's do, so that
    ``recv_x`` lives and dies by the same rule on every backend."""

    def __init__(self, num_buffers: int):
        self.tensors = [None] * num_buffers
        self.next_cpu = 0


_ll_recv: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # LowLatencyGroup -> _LLBuffers


def _ll_buffers(group) -> _LLBuffers:
    st = _ll_recv.get(group)
    if st is None:
        st = _ll_recv[group] = _LLBuffers(group.num_buffers)
    return st


class TorchLLHandle(NamedTuple):
    """The routing of one :func:`ll_dispatch`: ``slot_topk`` (int32 ``[L, R*Tmax]``, the first k of the
    slot's token with that expert, -1 = empty slot: the validity mask is ``slot_topk >= 0``),
    ``slot_weights`` (fp32 ``[L, R*Tmax]``, differentiable: its gradient reaches ``topk_weights``),
    ``counts`` (int32 ``[L]``, valid slots per local expert), ``topk_weights`` (the caller's tensor, through
    which :func:`ll_combine`'s weight gradient flows), ``group``, ``core`` (the
    :class:`moe_rt.LowLatencyHandle`) and ``buffer_set`` (the group's buffer set ``recv_x`` lives in)."""
    slot_topk: Tensor
    slot_weights: Tensor
    counts: Tensor
    topk_weights: Tensor
    group: object
    core: object
    buffer_set: int


def _ll_recv_view(group, b: int, fresh: Tensor) -> Tensor:
    """A new alias of the tensor over the group's receive buffer of set ``b``, which a dispatch-direction op
    has just written (its result is ``fresh``): the tensor's version counter is bumped first, so autograd
    raises "modified by an inplace operation" for any alias saved before."""
    st = _ll_buffers(group)
    buf = st.tensors[b]
    if fresh.device.type == "cpu":
        if buf is None:
            with torch.inference_mode(False):
                buf = st.tensors[b] = torch.empty_like(fresh)
        with torch.no_grad():
            buf.copy_(fresh)
    elif buf is None or buf.data_ptr() != fresh.data_ptr():
        with torch.inference_mode(False):  # inference tensors have no version counter
            buf = st.tensors[b] = _arrays.export(group._view("recv", b, group._slots_shape(), group.dtype), "torch")
        if buf.data_ptr() != fresh.data_ptr():
            raise RuntimeError("LowLatencyGroup: the op's result is not the group's receive buffer")
    increment_version(buf)
    with torch.inference_mode(False):
        return buf.detach()


class _LLDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, group, topk_idx, copy, fp8, scales):
        # fp8: FP8 on the wire, the rows dequantized on the receiving side (straight-through gradient); x and
        # scales a pre-quantized pair when scales is given (no gradient to the codes)
        xin = x.detach() if scales is None else (x.detach(), scales.detach())
        recv, counts, core = group.dispatch(xin, topk_idx.detach(), topk_weights.detach(), fp8=fp8,
                                            dequantize=fp8)
        if core.backend == "cpu":  # the reference has no buffer sets: take turns as the GPU does
            st = _ll_buffers(group)
            b, st.next_cpu = st.next_cpu, (st.next_cpu + 1) % group.num_buffers
        else:
            b = core.buffer_set
        if copy:  # a new tensor, zero at empty slots (the receive buffer is still rewritten: bump it)
            recv = torch.where(core.slot_topk[..., None] >= 0, _ll_recv_view(group, b, recv), 0)
        else:
            recv = _ll_recv_view(group, b, recv)
        ctx.group, ctx.core = group, core
        ctx.w_dtype = topk_weights.dtype
        ctx.mark_non_differentiable(core.slot_topk, counts)
        return recv, core.slot_weights, core.slot_topk, counts, core, b

    @staticmethod
    def backward(ctx, grad_recv, grad_slot_weights, _slot_topk, _counts, _core, _set):
        need_w = ctx.needs_input_grad[1]
        gx, gw = ctx.group.dispatch_bwd(ctx.core, grad_recv.contiguous(),
                                        grad_slot_weights.contiguous() if need_w else None)
        return ((gx if ctx.needs_input_grad[0] else None), (gw.to(ctx.w_dtype) if need_w else None), None, None,
                None, None, None)


class _LLCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, topk_weights, group, core, b):
        out = group.combine(core, expert_out.detach())
        ctx.group, ctx.core, ctx.set, ctx.w_dtype = group, core, b, topk_weights.dtype
        ctx.save_for_backward(expert_out if ctx.needs_input_grad[1] else None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (y,) = ctx.saved_tensors  # checked against later writes of the receive buffer by autograd
        group = ctx.group
        if y is not None:
            y = y.detach()
            buf = _ll_buffers(group).tensors[ctx.set]
            if buf is not None and y.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
                y = y.clone()  # expert_out is recv_x itself (an identity expert): combine_bwd overwrites it
        gy, gw = group.combine_bwd(ctx.core, grad_out.contiguous(), y)
        gy = _ll_recv_view(group, ctx.set, gy)
        return ((gy if ctx.needs_input_grad[0] else None), (gw.to(ctx.w_dtype) if y is not None else None), None,
                None, None)


def _ll_group(group):
    from moe_rt.ep_ll import LowLatencyGroup

    if not isinstance(group, LowLatencyGroup):
        raise TypeError(f"group: expected a moe_rt.LowLatencyGroup, got {type(group).__name__}")
    return group


@torch.compiler.disable
def ll_dispatch(group, x, topk_idx: Tensor, topk_weights: Tensor, *, copy: bool = False, fp8: bool = False,
                dequantize: bool = False) -> tuple[Tensor, Tensor, TorchLLHandle]:
    """Differentiable :meth:`moe_rt.LowLatencyGroup.dispatch` (a collective; no host sync).

    Args:
        group: a :class:`moe_rt.LowLatencyGroup`.
        x: ``[T,H]`` in the group's dtype, ``T <= max_tokens_per_rank``; with ``fp8=True`` also a
            pre-quantized pair ``(x_fp8 [T,H] float8_e4m3fn or uint8, scales [T, ceil(H/128)] float32)``.
        topk_idx: ``[T,K]`` int32/int64, ids in ``[-1, E)`` (not differentiable).
        topk_weights: ``[T,K]`` float: the weights :func:`ll_combine` applies.
        copy: False (default): ``recv_x`` is a view of the group's receive buffer (zero copy; the rules
            below). True: a new tensor with zero rows at empty slots, the caller's to keep (one pass over
            ``[L, R*Tmax, H]``): the form for training, and the one to use under ``torch.compile``, whose
            partitioner may save ``recv_x`` itself to recompute a copy made in the compiled graph.
        fp8, dequantize: ``fp8=True, dequantize=True`` (a group made with ``fp8=True``) sends FP8 rows (e4m3
            codes and one fp32 scale per 128 channels, quantized inside the push; about half the bytes on
            the wire) and returns them dequantized in the group's dtype, as ``recv_x`` otherwise is; the
            gradient is straight-through (the quantization counts as the identity: ``x`` gets the float
            ``dispatch_bwd`` of ``recv_x``'s gradient, as :func:`moe_rt.torch.ep_dispatch` with
            ``dequantize=True``); a pair's codes get none. ``fp8=True`` alone (the codes and scales
            themselves, for an FP8 grouped GEMM) carries no gradient: it is
            :meth:`moe_rt.LowLatencyGroup.dispatch` with ``fp8=True`` itself (torch tensors in and out), which
            this function refuses with a ValueError naming it.

    Returns:
        ``(recv_x [L, R*Tmax, H], counts [L] int32, handle)``: token ``t`` of rank ``s`` for local expert
        ``l`` at row ``(l, s*Tmax + t)``; rows of empty slots (``handle.slot_topk < 0``) unspecified
        (zero with ``copy=True``).
        Gradients flow to ``x`` (through ``dispatch_bwd``) and to ``topk_weights`` (through
        :func:`ll_combine` and ``handle.slot_weights``).

    ``recv_x`` is a view of the group's receive buffer, valid until the group's next dispatch or
    combine backward (which writes the expert outputs' gradient there) in the same buffer set (with
    ``num_buffers=2`` dispatches alternate between two sets). Autograd enforces it: every such
    write bumps the buffer's version counter, so an expert that saved ``recv_x`` for its backward raises
    "one of the variables needed for gradient computation has been modified by an inplace operation"
    instead of reading the gradient. Training code runs the expert on a copy: ``copy=True``, or in eager
    code ``torch.where(handle.slot_topk[..., None] >= 0, recv_x, 0)`` (the same; the zero rows keep an
    expert weight gradient over every row finite and exact).

    Each call is a whole dispatch (the group's split ``return_recv_hook`` is not offered here).
    Eager only: a ``torch.autograd.Function``, not a ``torch.library`` custom op, since ``recv_x`` aliases
    the group's buffer and each op bumps its version counter (a custom op may do neither); under
    ``torch.compile`` the call runs outside the compiled graph. Every rank must run the same
    sequence of these ops, forward and backward.
    """
    _ll_group(group)
    _A.check_ll_fp8(group, fp8, dequantize)
    scales = None
    if isinstance(x, (tuple, list)):
        _A.check_pair_arity(x, fp8)
        x, scales = x
        _tensor(x, "x_fp8")
        _tensor(scales, "scales")
    else:
        _tensor(x, "x")
    _tensor(topk_idx, "topk_idx")
    _tensor(topk_weights, "topk_weights")
    recv, slot_w, slot_k, counts, core, b = _LLDispatch.apply(x, topk_weights, group, topk_idx, bool(copy),
                                                              bool(fp8), scales)
    return recv, counts, TorchLLHandle(slot_k, slot_w, counts, topk_weights, group, core, b)


@torch.compiler.disable
def ll_combine(handle: TorchLLHandle, expert_out: Tensor) -> Tensor:
    """Differentiable :meth:`moe_rt.LowLatencyGroup.combine` (a collective; no host sync): ``out[t] = sum_k
    topk_weights[t,k] * expert_out[slot(t,k)]`` (fp32, k ascending, rounded once) with the weights given
    to :func:`ll_dispatch` (a group made with ``combine_partials=True``: its rank-partial sum, docs/ep.md §8). ``expert_out [L, R*Tmax, H]`` in ``recv_x``'s layout (only valid slots are
    read). Gradients flow to ``expert_out`` (a view of the receive buffer, zero at empty slots, valid until
    the group's next dispatch-direction op) and to ``topk_weights``."""
    if not isinstance(handle, TorchLLHandle):
        raise TypeError(f"handle: expected a TorchLLHandle from moe_rt.torch.ll_dispatch, got "
                        f"{type(handle).__name__}")
    _tensor(expert_out, "expert_out")
    return _LLCombine.apply(expert_out, handle.topk_weights, handle.group, handle.core, handle.buffer_set)
