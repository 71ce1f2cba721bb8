"""TransformerEngine's PyTorch MoE functions over moe_rt: the same names, positional signatures, defaults,
return tuples and dtypes as ``transformer_engine.pytorch`` (router and permutation), so that replacing the
import is the whole migration::

    # from transformer_engine.pytorch import moe_permute, moe_unpermute, fused_topk_with_score_function
    from moe_rt.te import moe_permute, moe_unpermute, fused_topk_with_score_function

Every function is differentiable (``moe_rt.torch`` adapters: eager and ``torch.compile``), CUDA tensors run
moe_rt's kernels, CPU tensors the NumPy reference (TransformerEngine itself needs CUDA). Beyond
TransformerEngine: up to 16384 experts, CPU tensors, and errors as ValueError/TypeError (where
TransformerEngine asserts). docs/te.md maps each function and lists the differences.

The bit-packed routing map (``routing_map_format="bitmap_u8"``) and the dense ``topk_indices`` output buffer
work as in TransformerEngine (the permutation functions take neither a bitmap nor indices as a mask: a uint8
routing map is refused). Quantile Balancing (``qb_histogram``, ``qb_bin_bounds``, ``qb_histogram_mode``) runs
:func:`moe_rt.torch.topk_with_score_qb`, with any of the routing outputs; the bounds' values are checked on
the host once per tensor version (TransformerEngine's rule, so a CUDA graph can be captured after one eager
call; docs/te.md).

FP8: plain ``torch.float8_e4m3fn`` / ``float8_e5m2`` tensors are permuted bit for bit by the permute
functions (CPU and CUDA); their scale rows (e.g. ``[T, H/128]`` fp32) are permuted by the same call on the
scales with the same routing map. TransformerEngine's own quantized tensor classes (``Float8Tensor``,
``Float8BlockwiseQTensor``, ``MXFP8Tensor``) raise NotImplementedError: moe_rt cannot build them without
TransformerEngine. ``moe_unpermute`` refuses FP8 rows with a TypeError, as TransformerEngine refuses them.

Host syncs: :func:`moe_permute_and_pad_with_probs` reads the padded row count on the host (TransformerEngine
does the same), and :func:`moe_permute` with ``map_type="index"`` reads the largest expert id on the host
unless ``num_experts=`` (a moe_rt keyword) is given, since TransformerEngine's index map does not say how
many experts there are. A Quantile-Balancing call reads ``qb_bin_bounds`` on the host the first time it
sees a tensor version of it (TransformerEngine does the same). Nothing else syncs.
"""
from __future__ import annotations

import enum
import warnings
from typing import Optional, Union

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from moe_rt import torch as _mt

__all__ = ["RoutingMapFormat", "QBHistogramMode", "fused_topk_with_score_function",
           "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "moe_permute", "moe_unpermute",
           "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_sort_chunks_by_index",
           "moe_sort_chunks_by_index_with_probs"]


class RoutingMapFormat(enum.IntEnum):
    """TransformerEngine's ``NVTERoutingMapFormat`` values: BYTEMAP (bool map) and BITMAP_U8 (bit-packed)."""
    BYTEMAP = 0
    BITMAP_U8 = 1


class QBHistogramMode(enum.IntEnum):
    """TransformerEngine's ``NVTEQBHistogramMode`` values (``qb_histogram_mode`` takes the lowercase names)."""
    TWO_KERNEL = 0
    FUSED_ATOMIC = 1


_FORMATS = {"bytemap": 0, "bitmap_u8": 1}
_QB_MODES = ("two_kernel", "fused_atomic")


def _routing_map_format(fmt) -> str:
    """TransformerEngine's validation of ``routing_map_format``: moe_rt's name of the format."""
    if isinstance(fmt, bool) or not isinstance(fmt, (int, str)):
        raise TypeError(f"routing_map_format: expected an int, a RoutingMapFormat or 'bytemap' / 'bitmap_u8', "
                        f"got {fmt!r}")
    if isinstance(fmt, str):
        if fmt not in _FORMATS:
            raise ValueError(f"routing_map_format: a string must be 'bytemap' or 'bitmap_u8' (lowercase), "
                             f"got {fmt!r}")
        fmt = _FORMATS[fmt]
    if int(fmt) not in (0, 1):
        raise ValueError(f"routing_map_format: an int must be 0 (BYTEMAP) or 1 (BITMAP_U8), got {fmt!r}")
    return "bitmap_u8" if int(fmt) == 1 else "bytemap"


# qb_bin_bounds tensors checked on the host, with the tensor version (``_version``) they were checked at: a
# tracked in-place write (fill_, copy_, ...) bumps the version and forces a new check
_qb_checked = WeakIdKeyDictionary()


def _qb_bounds_validated(bounds) -> bool:
    """TransformerEngine's bounds bookkeeping: the values of ``qb_bin_bounds`` are checked (finite, lower <
    upper: ValueError) on the host once per tensor version, then the router runs unchecked (True), so
    that a CUDA graph can be captured after one eager call; the kernels read the bounds on the device, so
    replays see the values written there then (unchecked). Under torch.compile the op checks them itself
    (False). Unchecked bounds while a CUDA stream is captured raise RuntimeError, as in TransformerEngine."""
    if not isinstance(bounds, Tensor):
        raise TypeError(f"qb_bin_bounds: expected a torch.Tensor, got {type(bounds).__name__}")
    if torch.compiler.is_compiling():
        return False
    if bounds.dtype != torch.float32:
        raise TypeError(f"qb_bin_bounds: dtype must be float32, got {bounds.dtype}")
    if bounds.numel() != 2 or bounds.dim() != 1:
        raise ValueError(f"qb_bin_bounds: expected shape (2,), got {tuple(bounds.shape)}")
    version = bounds._version
    if _qb_checked.get(bounds) == version:
        return True
    if bounds.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("qb_bin_bounds must be validated by an eager router call before CUDA graph capture "
                           "(its values are checked on the host once per tensor version)")
    lo, hi = bounds.detach().cpu().tolist()
    from moe_rt.router import check_qb_bounds_values

    check_qb_bounds_values(lo, hi)
    _qb_checked[bounds] = version
    return True


def _groups(v):
    """TransformerEngine's grouping argument: None or a value <= 0 turns grouping off."""
    return None if v is None or (isinstance(v, int) and not isinstance(v, bool) and v <= 0) else v


# -- router ----------------------------------------------------------------------------------------------

def fused_topk_with_score_function(logits: Tensor, topk: int, use_pre_softmax: bool, num_groups: Optional[int],
                                   group_topk: Optional[int], scaling_factor: Optional[float],
                                   score_function: str, expert_bias: Optional[Tensor],
                                   routing_map_format: Union[str, RoutingMapFormat, int] = RoutingMapFormat.BYTEMAP,
                                   topk_indices: Optional[Tensor] = None, qb_histogram: Optional[Tensor] = None,
                                   qb_bin_bounds: Optional[Tensor] = None, qb_histogram_mode: Optional[str] = None):
    """Top-k routing with a score function (``"softmax"``, ``"sigmoid"``, ``"sqrtsoftplus"``).

    Returns ``(probs, routing_map)``: probs in the logits dtype and shape (zero off the selection),
    routing_map bool of the same shape. The gradient flows to ``logits``. ``logits`` may have any
    leading dims. ``num_groups``/``group_topk`` None (or <= 0) turn grouping off.

    ``routing_map_format=BITMAP_U8`` (or 1, or ``"bitmap_u8"``): the routing map bit-packed, uint8
    ``[..., ceil(E/8)]``, bit ``e % 8`` of byte ``e // 8`` (LSB first), padding bits 0; gradients equal the
    bool map's bit for bit. ``topk_indices``: a caller buffer ``[..., topk]`` int16/int32/int64 (contiguous,
    on the logits' device; int16 needs E <= 32767; not with BITMAP_U8): the expert ids are written into it
    and it is returned as the routing output (the same tensor); no map is built, probs stay dense, and the
    backward runs from the indices. Each row's ids are in ascending expert id (TransformerEngine's rows
    follow its selection order; the sets are the same).
    """
    if isinstance(logits, Tensor) and logits.dtype == torch.float64:
        raise ValueError("logits: float64 router logits are not supported (fp32, bf16 or fp16)")
    fmt = _routing_map_format(routing_map_format)
    qb = (qb_histogram, qb_bin_bounds, qb_histogram_mode)
    if any(v is not None for v in qb):
        if any(v is None for v in qb):
            raise ValueError("qb_histogram, qb_bin_bounds, and qb_histogram_mode must be provided together")
        if score_function != "sigmoid":
            raise ValueError("Quantile Balancing only supports score_function='sigmoid'")
        if expert_bias is None:
            raise ValueError("Quantile Balancing requires expert_bias")
        if num_groups is not None or group_topk is not None:
            raise ValueError("Quantile Balancing does not support grouped Top-k")
        if qb_histogram_mode not in _QB_MODES:
            raise ValueError(f"qb_histogram_mode must be 'two_kernel' or 'fused_atomic', got {qb_histogram_mode!r}")
    if topk_indices is not None and fmt != "bytemap":
        raise ValueError("topk_indices: the dense index output cannot be combined with non-default "
                         "routing_map_format (BITMAP_U8)")
    if qb_histogram is not None:
        return _qb_topk(logits, topk, expert_bias, qb_histogram, qb_bin_bounds, qb_histogram_mode, scaling_factor,
                        fmt, topk_indices)
    if fmt == "bytemap" and topk_indices is None:
        return _mt.topk_with_score(logits, topk, score_function=score_function, use_pre_softmax=use_pre_softmax,
                                   num_groups=_groups(num_groups), group_topk=_groups(group_topk),
                                   scaling_factor=scaling_factor, expert_bias=expert_bias)
    return _mt.topk_with_score(logits, topk, score_function=score_function, use_pre_softmax=use_pre_softmax,
                               num_groups=_groups(num_groups), group_topk=_groups(group_topk),
                               scaling_factor=scaling_factor, expert_bias=expert_bias, routing_map_format=fmt,
                               topk_indices=topk_indices)


def _qb_topk(logits, topk, expert_bias, hist, bounds, mode, scaling_factor, fmt, topk_indices):
    """The Quantile-Balancing router with TransformerEngine's routing outputs: the bool map, the bit-packed
    map (the core op's packing) or the dense indices written into ``topk_indices`` (ascending expert id)."""
    from moe_rt import router as _router

    if topk_indices is not None:
        _router.check_topk_outputs(logits, topk, "bytemap", topk_indices, None)
        if tuple(topk_indices.shape) != tuple(logits.shape[:-1]) + (int(topk),):
            raise ValueError(f"topk_indices: expected shape {tuple(logits.shape[:-1]) + (int(topk),)}, got "
                             f"{tuple(topk_indices.shape)}")
        if topk_indices.device != logits.device or not topk_indices.is_contiguous():
            raise ValueError("topk_indices: the buffer must be contiguous and on the logits' device")
    probs, routing_map = _mt.topk_with_score_qb(logits, topk, expert_bias=expert_bias, qb_histogram=hist,
                                                qb_bin_bounds=bounds, qb_histogram_mode=mode,
                                                scaling_factor=scaling_factor,
                                                bounds_validated=_qb_bounds_validated(bounds))
    if topk_indices is not None:  # the k selected ids in ascending order: a stable sort puts them first
        ids = torch.argsort(routing_map.to(torch.int8), dim=-1, descending=True, stable=True)[..., :int(topk)]
        with torch.no_grad():
            topk_indices.copy_(ids)
        return probs, topk_indices
    if fmt != "bytemap":
        E = routing_map.shape[-1]
        pad = -E % 8
        bits = torch.nn.functional.pad(routing_map.to(torch.uint8), (0, pad))
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
        packed = (bits.reshape(*bits.shape[:-1], -1, 8) * weights).sum(-1, dtype=torch.uint8)
        return probs, packed
    return probs, routing_map


def fused_compute_score_for_moe_aux_loss(logits: Tensor, topk: int, score_function: str,
                                         routing_map_format: Union[str, RoutingMapFormat, int] =
                                         RoutingMapFormat.BYTEMAP):
    """The dense scores of the aux loss and their top-k map. Returns ``(routing_map bool, scores fp32)``
    (TransformerEngine's order: the map first); the gradient flows to ``logits`` in its dtype. BITMAP_U8:
    the map bit-packed, as for :func:`fused_topk_with_score_function`."""
    fmt = _routing_map_format(routing_map_format)
    if fmt == "bytemap":
        scores, routing_map = _mt.scores_for_aux_loss(logits, topk, score_function)
    else:
        scores, routing_map = _mt.scores_for_aux_loss(logits, topk, score_function, routing_map_format=fmt)
    return routing_map, scores


def fused_moe_aux_loss(probs: Tensor, tokens_per_expert: Tensor, total_num_tokens: Union[int, Tensor],
                       num_experts: int, topk: int, coeff: float) -> Tensor:
    """Switch load-balancing loss: ``(E*coeff/topk/T/T) * sum_c tokens_per_expert[c] * sum_r probs[r,c]``,
    a 0-d tensor in the probs dtype. ``total_num_tokens``: an int, or a one-element int tensor on the
    probs' device (read on the device: no sync, CUDA-graph capturable, replays see the value written
    there; not checked, so T <= 0 gives inf/NaN). The probs' columns are a multiple of ``num_experts``."""
    return _mt.aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)


# -- permutation helpers ---------------------------------------------------------------------------------

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_tensor(t, name):
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.__class__ is not Tensor and t.__class__.__name__ in ("Float8Tensor", "MXFP8Tensor",
                                                               "Float8BlockwiseQTensor"):
        raise NotImplementedError(
            f"{name}: TransformerEngine's quantized tensors ({t.__class__.__name__}) are not supported (moe_rt "
            "does not depend on TransformerEngine and cannot build its tensor classes). Pass the FP8 data as a "
            "plain torch.float8_e4m3fn / float8_e5m2 tensor (permuted bit for bit) and permute its scale rows "
            "with the same call (moe_permute(scales [T, S], routing_map, num_out_tokens)), or use "
            "moe_rt.dispatch_fp8(x_fp8, scales, plan); docs/te.md, 'FP8'")


class _ZeroRows(torch.autograd.Function):
    """``out`` with the rows whose permuted prob is exactly 0.0 set to zero (TransformerEngine's permute
    writes zero rows there); the gradient passes through unchanged, as in TransformerEngine's backward.
    FP8 rows are zeroed as bytes (the same bits: +0)."""

    @staticmethod
    def forward(ctx, out, permuted_probs):
        keep = (permuted_probs != 0).view(-1, *([1] * (out.dim() - 1)))
        if out.dtype in _FP8:
            return torch.where(keep, out.view(torch.uint8), 0).view(out.dtype)
        return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _mask_row_id_map(dst_row: Tensor) -> Tensor:
    """TransformerEngine's mask ``row_id_map [T, 2E+1]`` int32 from a routing-map plan's ``dst_row [T,E]``
    (slot e = expert e, -1 = not routed): the first n columns the destination rows in descending order,
    columns [E, E+n) their experts, column 2E the count n. The other entries are -1 and unrouted expert ids
    (TransformerEngine leaves them unspecified)."""
    rows, experts = torch.sort(dst_row, dim=1, descending=True, stable=True)
    n = (dst_row >= 0).sum(dim=1, dtype=torch.int32)
    return torch.cat([rows.to(torch.int32), experts.to(torch.int32), n[:, None]], dim=1)


def _plan_of_dst(dst_row: Tensor, num_rows: int, experts: Optional[Tensor], num_experts: int) -> _mt.TorchPlan:
    """A TorchPlan over ``dst_row [T,K]`` (traceable torch ops, no sync): ``src_slot`` inverted from it;
    per-expert counts from ``experts [T,K]`` (the expert of each slot), else one group holding every row."""
    T, K = dst_row.shape
    dev = dst_row.device
    dst = dst_row.to(torch.int32).contiguous()
    valid = dst >= 0
    flat = torch.where(valid, dst, num_rows).reshape(-1).to(torch.int64)
    slots = torch.arange(T * K, dtype=torch.int32, device=dev)
    src = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=dev)
    src = src.scatter(0, flat, slots)[:num_rows].contiguous()  # index num_rows collects the unrouted slots
    if experts is None:
        counts = valid.sum().to(torch.int32).reshape(1)
    else:
        e = torch.where(valid, experts, num_experts).reshape(-1).to(torch.int64)
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
        counts = counts.scatter_add(0, e, torch.ones_like(e, dtype=torch.int32))[:num_experts].contiguous()
    seg = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0, dtype=torch.int32)])
    return _mt.TorchPlan(dst, src, seg, counts, counts.clone(), int(counts.shape[0]), int(num_rows), 1, -1)


def _mask_map(routing_map, name="routing_map"):
    _check_tensor(routing_map, name)
    if routing_map.dim() != 2:
        raise ValueError(f"{name}: expected [num_tokens, num_experts], got shape {tuple(routing_map.shape)}")
    if routing_map.dtype == torch.uint8:
        raise TypeError(f"{name}: uint8 is the bit-packed routing map's dtype (routing_map_format=BITMAP_U8), "
                        "which the permutation functions do not take; pass the bool map (unpack the bitmap "
                        "first, or route with the default BYTEMAP)")
    return routing_map


def _num_out(num_out_tokens, low, what):
    if isinstance(num_out_tokens, bool) or not isinstance(num_out_tokens, int):
        raise TypeError(f"num_out_tokens: expected an int, got {type(num_out_tokens).__name__}")
    if num_out_tokens < low:
        raise ValueError(f"num_out_tokens: {what}, got {num_out_tokens}")
    return num_out_tokens


def _permute_mask(inp, routing_map, num_out_tokens, probs, align_size=1, num_kept=None):
    """Mask-map permute: ``(output, permuted_probs | None, row_id_map, plan)``."""
    _check_tensor(inp, "inp")
    routing_map = _mask_map(routing_map)
    T, E = routing_map.shape
    plan = _mt.make_plan(routing_map, E, align_size=align_size,
                         num_out_tokens=num_out_tokens if num_kept is None else num_kept, map_type="mask")
    out, pp = _mt.dispatch(inp, plan, probs)
    if pp is not None:
        out = _ZeroRows.apply(out, pp)
    return out, pp, plan


# -- permutation -----------------------------------------------------------------------------------------

def moe_permute(inp: Tensor, routing_map: Tensor, num_out_tokens: int = 0, max_token_num: int = -1,
                map_type: str = "mask", *, num_experts: Optional[int] = None):
    """Group tokens by expert. Returns ``(output, row_id_map)``.

    ``map_type="mask"``: ``routing_map [T,E]`` bool or integer 0/1; ``num_out_tokens`` > 0 rows (routed
    slots beyond it are dropped in expert-major order; rows beyond the routed count are zero);
    ``row_id_map [T, 2E+1]`` int32. ``map_type="index"``: ``routing_map [T,topK]`` expert ids
    (-1 = none); ``num_out_tokens`` >= 0, 0 meaning ``T*topK``; rows ordered by (expert, t*topK + k),
    sorted positions >= num_out_tokens dropped (-1 in the map); ``row_id_map [topK*T]`` int32, k-major.
    ``max_token_num`` only sized TransformerEngine's workspace (accepted, unused). ``num_experts`` (moe_rt
    only, index maps): the expert count; None reads the largest id on the host (one sync).
    """
    _check_tensor(inp, "inp")
    if map_type not in ("mask", "index"):
        raise ValueError("map_type should be one of 'mask' or 'index'")
    _check_tensor(routing_map, "routing_map")
    if routing_map.dim() != 2:
        raise ValueError(f"routing_map: expected a 2-D tensor, got shape {tuple(routing_map.shape)}")
    T = routing_map.shape[0]
    if map_type == "mask":
        E = routing_map.shape[1]
        if T == 0 or inp.numel() == 0:
            return inp.clone(), torch.empty((T, 2 * E + 1), dtype=torch.int32, device=inp.device)
        _num_out(num_out_tokens, 1, "a mask map needs num_out_tokens > 0")
        out, _, plan = _permute_mask(inp, routing_map, num_out_tokens, None)
        return out, _mask_row_id_map(plan.dst_row)
    K = routing_map.shape[1]
    _num_out(num_out_tokens, 0, "must be >= 0 (0 means num_tokens * topK)")
    if routing_map.dtype != torch.int32:
        if routing_map.dtype not in (torch.int64, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"routing_map: expected integer expert ids, got dtype {routing_map.dtype}")
        warnings.warn(f"The data type of the input `routing_map` of Permute is {routing_map.dtype}! "
                      f"The recommended type is torch.int32.")
        routing_map = routing_map.to(torch.int32)
    if T == 0 or inp.numel() == 0:
        return inp.clone(), torch.empty((T * K,), dtype=torch.int32, device=inp.device)
    if num_experts is None:
        num_experts = max(int(routing_map.max().item()) + 1, 1)  # the documented host read
    nout = num_out_tokens if num_out_tokens > 0 else T * K
    plan = _mt.make_plan(routing_map, num_experts, num_out_tokens=nout, map_type="index")
    out, _ = _mt.dispatch(inp, plan)
    return out, plan.dst_row.t().reshape(-1).contiguous()


def moe_permute_with_probs(inp: Tensor, probs: Tensor, routing_map: Tensor, num_out_tokens: int = 0):
    """Mask-map permute of tokens and their probs. Returns ``(output, permuted_probs, row_id_map)``:
    ``permuted_probs [num_out_tokens]`` in the probs dtype; a row whose prob is exactly 0.0 is a zero row.
    ``probs [T,E]``; gradients flow to ``inp`` and ``probs``."""
    _check_tensor(probs, "probs")
    routing_map = _mask_map(routing_map)
    T, E = routing_map.shape
    if T == 0 or inp.numel() == 0:
        return (inp.clone(), probs.new_empty((0,)),
                torch.empty((T, 2 * E + 1), dtype=torch.int32, device=inp.device))
    _num_out(num_out_tokens, 1, "a mask map needs num_out_tokens > 0")
    out, pp, plan = _permute_mask(inp, routing_map, num_out_tokens, probs)
    return out, pp, _mask_row_id_map(plan.dst_row)


def moe_permute_and_pad_with_probs(inp: Tensor, probs: Tensor, routing_map: Tensor, tokens_per_expert: Tensor,
                                   align_size: int):
    """Mask-map permute with each expert's rows padded to a multiple of ``align_size`` (zero rows).

    Returns ``(output, permuted_probs, row_id_map, pad_offsets, target_tokens_per_expert)``:
    ``target = ceil(tokens_per_expert / align_size) * align_size`` (int64), output ``[sum(target), H]``,
    ``pad_offsets [E]`` int64 the exclusive cumsum of the padding (None when nothing is padded),
    ``row_id_map`` the unpadded mask map (pass ``pad_offsets`` to :func:`moe_unpermute`).

    **Host sync**: the row count ``sum(target)`` (and whether anything is padded) is read on the host, as
    TransformerEngine does, so this call cannot be captured in a CUDA graph.
    """
    if tokens_per_expert is None:
        raise ValueError("tokens_per_expert: required to pad (got None)")
    if isinstance(align_size, bool) or not isinstance(align_size, int):
        raise TypeError(f"align_size: expected an int, got {type(align_size).__name__}")
    if align_size <= 0:
        raise ValueError(f"align_size: must be > 0, got {align_size}")
    _check_tensor(tokens_per_expert, "tokens_per_expert")
    _check_tensor(probs, "probs")
    routing_map = _mask_map(routing_map)
    T, E = routing_map.shape
    if tokens_per_expert.shape != (E,):
        raise ValueError(f"tokens_per_expert: expected shape ({E},), got {tuple(tokens_per_expert.shape)}")
    tpe = tokens_per_expert.to(torch.int64)
    target = (tpe + align_size - 1) // align_size * align_size
    pad = target - tpe
    routed, rows, padded = (int(v) for v in torch.stack([tpe.sum(), target.sum(), pad.sum()]).tolist())
    pad_offsets = (torch.cumsum(pad, 0) - pad) if padded else None
    out, pp, plan = _permute_mask(inp, routing_map, None, probs, align_size=align_size, num_kept=max(routed, 0))
    out, pp = out[:rows], pp[:rows]
    dst = plan.dst_row
    if pad_offsets is not None:
        dst = torch.where(dst >= 0, dst - pad_offsets[None, :].to(dst.dtype), dst)
    return out, pp, _mask_row_id_map(dst), pad_offsets, target


def moe_unpermute(inp: Tensor, row_id_map: Tensor, merging_probs: Optional[Tensor] = None,
                  restore_shape: Optional[torch.Size] = None, map_type: str = "mask", probs: Optional[Tensor] = None,
                  pad_offsets: Optional[Tensor] = None) -> Tensor:
    """Sum each token's expert outputs back into token order, weighted by ``merging_probs`` (fp32
    accumulation). ``map_type="mask"``: ``row_id_map [T,2E+1]``, ``merging_probs [T,E]`` (gradient in its
    dtype), ``restore_shape`` the output shape ``[T,H]`` (default ``inp.shape``, TransformerEngine's
    default), ``pad_offsets`` from :func:`moe_permute_and_pad_with_probs`. ``map_type="index"``:
    ``row_id_map [topK*T]``, ``merging_probs [T,topK]`` fp32 (other dtypes are cast with a warning;
    without it topK = 1). ``probs`` is the deprecated name of ``merging_probs``."""
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("Both merging_probs and probs kwarg are provided. probs is deprecated.")
        warnings.warn("probs kwarg is deprecated. Use merging_probs kwarg instead.")
        merging_probs = probs
    if map_type not in ("mask", "index"):
        raise ValueError("map_type should be one of 'mask' or 'index'")
    _check_tensor(inp, "inp")
    _check_tensor(row_id_map, "row_id_map")
    if merging_probs is not None:
        _check_tensor(merging_probs, "merging_probs")
    if inp.dim() != 2:
        raise ValueError(f"inp: expected [num_rows, hidden], got shape {tuple(inp.shape)}")
    if inp.dtype in _FP8:
        raise TypeError(f"inp: {inp.dtype} rows cannot be unpermuted (a weighted sum; TransformerEngine refuses "
                        "FP8 in moe_unpermute too): dequantize them first (moe_rt.dequantize_fp8)")
    if row_id_map.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"row_id_map: expected int32, got dtype {row_id_map.dtype}")
    N, H = inp.shape
    if map_type == "index":
        if merging_probs is not None and merging_probs.dtype != torch.float32:
            warnings.warn(f"The data type of the input `probs` of Unpermute is {merging_probs.dtype}! "
                          f"The recommended type is torch.float32.")
            merging_probs = merging_probs.to(torch.float32)
        K = merging_probs.shape[1] if merging_probs is not None else 1
        if row_id_map.dim() != 1 or row_id_map.shape[0] % K:
            raise ValueError(f"row_id_map: expected [topK*T] = a multiple of {K} entries, got shape "
                             f"{tuple(row_id_map.shape)}")
        T = row_id_map.shape[0] // K
        if merging_probs is not None and merging_probs.shape[0] != T:
            raise ValueError(f"merging_probs: expected [{T}, {K}], got {tuple(merging_probs.shape)}")
        if inp.numel() == 0:
            out = inp.new_zeros((T, H))
            return out if merging_probs is None else out + merging_probs.sum() * 0
        plan = _plan_of_dst(row_id_map.view(K, T).t(), N, None, 1)
        return _mt.combine(inp, plan, merging_probs)
    if row_id_map.dim() != 2 or row_id_map.shape[1] % 2 != 1:
        raise ValueError(f"row_id_map: expected a mask map [T, 2E+1], got shape {tuple(row_id_map.shape)}")
    E = (row_id_map.shape[1] - 1) // 2
    if inp.numel() == 0:
        if merging_probs is not None:
            return inp + merging_probs.sum() * 0
        return inp
    T, Hr = tuple(restore_shape) if restore_shape is not None else (N, H)
    if Hr != H:
        raise ValueError(f"restore_shape: hidden size {Hr} differs from inp's {H}")
    if T != row_id_map.shape[0]:
        raise ValueError(f"restore_shape: {T} tokens, but row_id_map has {row_id_map.shape[0]} rows "
                         f"(restore_shape defaults to inp.shape; pass [num_tokens, hidden])")
    if merging_probs is not None and tuple(merging_probs.shape) != (T, E):
        raise ValueError(f"merging_probs: expected [{T}, {E}], got {tuple(merging_probs.shape)}")
    rows, experts, n = row_id_map[:, :E], row_id_map[:, E:2 * E], row_id_map[:, 2 * E:]
    valid = torch.arange(E, device=row_id_map.device)[None, :] < n
    if pad_offsets is not None:
        _check_tensor(pad_offsets, "pad_offsets")
        if pad_offsets.shape != (E,):
            raise ValueError(f"pad_offsets: expected shape ({E},), got {tuple(pad_offsets.shape)}")
        rows = rows + pad_offsets.to(rows.dtype)[torch.where(valid, experts, 0).long()]
    col = torch.where(valid, experts, E).long()
    dst = torch.full((T, E + 1), -1, dtype=torch.int32, device=row_id_map.device)
    dst = dst.scatter(1, col, torch.where(valid, rows, -1).to(torch.int32))[:, :E]
    plan = _plan_of_dst(dst, N, torch.arange(E, dtype=torch.int32, device=dst.device).expand(T, E), E)
    return _mt.combine(inp, plan, merging_probs)


def moe_sort_chunks_by_index(inp: Tensor, split_sizes: Tensor, sorted_index: Tensor) -> Tensor:
    """Reorder chunks of rows: ``inp``'s rows split by ``split_sizes``, put in the order ``sorted_index``.
    Returns the output tensor alone (as TransformerEngine does, whatever its docstring says)."""
    _check_tensor(inp, "inp")
    if inp.numel() == 0:
        return inp
    return _mt.sort_chunks(inp, split_sizes, sorted_index)


def moe_sort_chunks_by_index_with_probs(inp: Tensor, probs: Tensor, split_sizes: Tensor, sorted_index: Tensor):
    """:func:`moe_sort_chunks_by_index` with ``probs [T]`` reordered alike. Returns ``(output,
    permuted_probs)``, the probs in their dtype."""
    _check_tensor(inp, "inp")
    _check_tensor(probs, "probs")
    if inp.numel() == 0:
        return inp, probs
    out, po = _mt.sort_chunks(inp, split_sizes, sorted_index, probs=probs)
    return out, po.to(probs.dtype)
