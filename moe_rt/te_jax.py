"""TransformerEngine's JAX MoE functions over moe_rt: the names, signatures, defaults and return tuples of
``transformer_engine.jax`` (router and permutation), so that replacing the import is the whole migration::

    # from transformer_engine.jax.router import fused_topk_with_score_function, fused_moe_aux_loss
    # from transformer_engine.jax.permutation import token_dispatch, token_combine, sort_chunks_by_index
    from moe_rt.te_jax import (fused_topk_with_score_function, fused_moe_aux_loss, token_dispatch,
                               token_combine, sort_chunks_by_index)

Every function works under ``jax.jit`` and ``jax.grad`` (``moe_rt.jax``); CUDA arrays run moe_rt's kernels,
CPU arrays the NumPy reference. Conventions kept from TransformerEngine: ``-1`` (any value <= 0) turns
grouping off, ``[B,S,...]`` inputs are flattened to tokens, routing maps are 0/1 integer (or bool) arrays,
the aux loss takes T and E from the probs' shape. Beyond TransformerEngine: ``"sqrtsoftplus"``, up to
16384 experts, CPU arrays, no host syncs anywhere. ``routing_map_format="bitmap_u8"`` returns the bit-packed
map (uint8 ``[..., ceil(E/8)]``, LSB first, zero padding bits), which :func:`token_dispatch` does not take (a
uint8 routing map is refused). docs/te.md maps each function.
"""
from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np

from moe_rt import jax as _mj

__all__ = ["ScoreFunction", "RoutingMapFormat", "fused_topk_with_score_function", "fused_moe_aux_loss",
           "token_dispatch", "token_combine", "sort_chunks_by_index"]


class ScoreFunction(enum.IntEnum):
    """TransformerEngine JAX's score functions (SIGMOID=0, SOFTMAX=1), plus moe_rt's SQRTSOFTPLUS."""
    SIGMOID = 0
    SOFTMAX = 1
    SQRTSOFTPLUS = 2


class RoutingMapFormat(enum.IntEnum):
    """TransformerEngine's routing map formats: BYTEMAP (bool map) and BITMAP_U8 (bit-packed)."""
    BYTEMAP = 0
    BITMAP_U8 = 1


def _score_function(sf) -> str:
    if isinstance(sf, str):
        name = sf.lower()
        if name in ("sigmoid", "softmax", "sqrtsoftplus"):
            return name
        raise ValueError(f"score_function: expected 'softmax', 'sigmoid' or 'sqrtsoftplus', got {sf!r}")
    if isinstance(sf, (int, np.integer)) and not isinstance(sf, bool) and int(sf) in (0, 1, 2):
        return ScoreFunction(int(sf)).name.lower()
    raise ValueError(f"score_function: expected a string or a ScoreFunction, got {sf!r}")


def _routing_map_format(fmt) -> str:
    if isinstance(fmt, str):
        v = {"bytemap": 0, "bitmap_u8": 1}.get(fmt.lower())
        if v is None:
            raise ValueError(f"routing_map_format: expected 'bytemap' or 'bitmap_u8', got {fmt!r}")
    elif isinstance(fmt, (int, np.integer)) and not isinstance(fmt, bool):
        v = int(fmt)
        if v not in (0, 1):
            raise ValueError(f"routing_map_format: expected 0 (BYTEMAP) or 1 (BITMAP_U8), got {fmt!r}")
    else:
        raise ValueError(f"routing_map_format: expected a RoutingMapFormat, an int or a string, got {fmt!r}")
    return "bitmap_u8" if v == 1 else "bytemap"


def _group(v, name):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int (-1 = off), got {type(v).__name__}")
    return None if v <= 0 else int(v)


# -- router ----------------------------------------------------------------------------------------------

def fused_topk_with_score_function(logits, topk: int, use_pre_softmax: bool = False, num_groups: int = -1,
                                   group_topk: int = -1, scaling_factor: float = 1.0,
                                   score_function=ScoreFunction.SOFTMAX, expert_bias=None,
                                   compute_aux_scores: bool = False, routing_map_format=RoutingMapFormat.BYTEMAP):
    """Top-k routing, or with ``compute_aux_scores=True`` the aux-loss scores.

    Returns ``(probs_or_scores, routing_map)`` with the logits' shape (any leading dims): probs in the
    logits dtype (zero off the selection) and a bool map. ``compute_aux_scores=True`` ignores the bias,
    pre-softmax, groups and scaling and returns the dense scores (softmax, or sigmoid normalized by its row
    sum + 1e-20) in the logits dtype (computed in fp32) with their top-k map. The gradient flows to
    ``logits`` only. ``routing_map_format=BITMAP_U8`` (1, or ``"bitmap_u8"`` in any case): the map
    bit-packed, uint8 ``[..., ceil(E/8)]``, bit ``e % 8`` of byte ``e // 8``; the gradients are the bool
    map's, bit for bit.
    """
    fmt = _routing_map_format(routing_map_format)
    fkw = {} if fmt == "bytemap" else {"routing_map_format": fmt}
    sf = _score_function(score_function)
    if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, (int, float)):
        raise TypeError(f"scaling_factor: expected a Python number, got {type(scaling_factor).__name__}")
    if expert_bias is not None and sf == "softmax":
        raise ValueError("expert_bias: only used with the sigmoid (or sqrtsoftplus) score function")
    if compute_aux_scores:
        scores, routing_map = _mj.scores_for_aux_loss(logits, topk, sf, **fkw)
        return scores.astype(logits.dtype), routing_map
    return _mj.topk_with_score(logits, topk, score_function=sf, use_pre_softmax=bool(use_pre_softmax),
                               num_groups=_group(num_groups, "num_groups"),
                               group_topk=_group(group_topk, "group_topk"),
                               scaling_factor=float(scaling_factor), expert_bias=expert_bias, **fkw)


def fused_moe_aux_loss(probs, tokens_per_expert, topk: int, coeff: float):
    """Switch load-balancing loss with T and E from ``probs [T,E]``: ``(E*coeff/topk/T/T) * sum_e
    tokens_per_expert[e] * sum_t probs[t,e]``, 0-d in the probs dtype."""
    probs, tokens_per_expert = _mj._array(probs, "probs"), _mj._array(tokens_per_expert, "tokens_per_expert")
    if probs.ndim != 2:
        raise ValueError(f"probs: expected [num_tokens, num_experts], got shape {probs.shape}")
    T, E = probs.shape
    return _mj.aux_loss(probs, tokens_per_expert, int(T), int(E), topk, coeff)


# -- permutation -----------------------------------------------------------------------------------------

@jax.custom_vjp
def _zero_rows(out, permuted_probs):
    """Rows whose permuted prob is exactly 0.0 become zero (TransformerEngine's permute writes zero rows
    there); the gradient passes through unchanged."""
    return jnp.where((permuted_probs != 0)[:, None], out, jnp.zeros((), out.dtype))


def _zero_rows_fwd(out, permuted_probs):
    return _zero_rows(out, permuted_probs), jnp.zeros((0,), permuted_probs.dtype)


def _zero_rows_bwd(like, g):
    return g, jnp.zeros((g.shape[0],), like.dtype)


_zero_rows.defvjp(_zero_rows_fwd, _zero_rows_bwd)


def _mask_row_id_map(dst_row):
    """TransformerEngine's mask ``row_id_map [T, 2E+1]`` int32 from ``dst_row [T,E]`` (slot e = expert e):
    destinations descending, their experts, then the count (other entries: -1 and unrouted ids)."""
    experts = jnp.argsort(-dst_row, axis=1, stable=True).astype(jnp.int32)
    rows = jnp.take_along_axis(dst_row, experts, axis=1)
    n = jnp.sum(dst_row >= 0, axis=1, dtype=jnp.int32)
    return jnp.concatenate([rows, experts, n[:, None]], axis=1).astype(jnp.int32)


def token_dispatch(inp, routing_map, num_out_tokens: int, probs=None, align_size=None):
    """Group tokens by expert (mask routing map).

    Args:
        inp: ``[T,H]`` or ``[B,S,H]``.
        routing_map: ``[T,E]`` or ``[B,S,E]``, 0/1 integers (or bool).
        num_out_tokens: a static int > 0: the routed slots kept (in expert-major order).
        probs: None or ``[T,E]`` / ``[B,S,E]``.
        align_size: None, or pad each expert's rows to a multiple of it (zero rows).

    Returns:
        ``(output [rows, H], permuted_probs [rows] probs dtype | None, row_id_map [T, 2E+1] int32,
        pad_offsets [E] int32 | None, tokens_per_expert [E] int32)``; ``rows`` is ``num_out_tokens``, or
        with ``align_size`` A ``((num_out_tokens + E*(A-1)) // A) * A``. A row whose prob is exactly 0.0
        is a zero row. Gradients flow to ``inp`` and ``probs``.
    """
    if isinstance(num_out_tokens, bool) or not isinstance(num_out_tokens, (int, np.integer)):
        raise TypeError(f"num_out_tokens: expected a static int, got {type(num_out_tokens).__name__}")
    if num_out_tokens <= 0:
        raise ValueError(f"num_out_tokens: must be > 0, got {num_out_tokens}")
    if align_size is not None and (isinstance(align_size, bool) or not isinstance(align_size, (int, np.integer))
                                   or align_size <= 0):
        raise ValueError(f"align_size: expected None or an int > 0, got {align_size!r}")
    inp, routing_map = _mj._array(inp, "inp"), _mj._array(routing_map, "routing_map")
    if inp.ndim not in (2, 3) or routing_map.ndim != inp.ndim:
        raise ValueError(f"inp, routing_map: expected [T,H] and [T,E] (or [B,S,H] and [B,S,E]), got shapes "
                         f"{inp.shape} and {routing_map.shape}")
    if routing_map.dtype == jnp.uint8:
        raise TypeError("routing_map: uint8 is the bit-packed routing map's dtype (routing_map_format=BITMAP_U8), "
                        "which token_dispatch does not take; pass the 0/1 int32 (or bool) map")
    E = routing_map.shape[-1]
    x = inp.reshape(-1, inp.shape[-1])
    rmap = routing_map.reshape(-1, E)
    if x.shape[0] != rmap.shape[0]:
        raise ValueError(f"routing_map: {rmap.shape[0]} tokens, inp has {x.shape[0]}")
    p = None
    if probs is not None:
        p = _mj._array(probs, "probs").reshape(-1, E)
        if p.shape != rmap.shape:
            raise ValueError(f"probs: expected the routing map's shape {routing_map.shape}, got {probs.shape}")
    A = 1 if align_size is None else int(align_size)
    plan = _mj.make_plan(rmap, E, align_size=A, num_out_tokens=int(num_out_tokens), map_type="mask")
    out, pp = _mj.dispatch(x, plan, p)
    if pp is not None:
        out = _zero_rows(out, pp)
    dst = plan.dst_row
    pad_offsets = None
    if align_size is not None:
        pad = plan.tokens_per_expert - plan.counts
        pad_offsets = (jnp.cumsum(pad) - pad).astype(jnp.int32)
        dst = jnp.where(dst >= 0, dst - pad_offsets[None, :], dst)
    return out, pp, _mask_row_id_map(dst), pad_offsets, plan.tokens_per_expert


def _plan_of_dst(dst, num_rows, E):
    """A JaxPlan over a routing-map ``dst_row [T,E]`` (traceable, no sync): src_slot inverted from it,
    per-expert counts from the routed slots."""
    T = dst.shape[0]
    valid = dst >= 0
    flat = jnp.where(valid, dst, num_rows).reshape(-1)
    src = jnp.full((num_rows + 1,), -1, jnp.int32).at[flat].set(jnp.arange(T * E, dtype=jnp.int32))[:num_rows]
    counts = jnp.sum(valid, axis=0, dtype=jnp.int32)
    seg = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    return _mj.JaxPlan((dst.astype(jnp.int32), src, seg, counts, counts), E, num_rows, 1, -1)


def token_combine(inp, row_id_map, merging_probs=None, pad_offsets=None):
    """Sum each token's expert rows back: ``out[t] = sum_e inp[dst(t,e)] * merging_probs[t,e]`` (fp32
    accumulation; a plain sum without probs). ``row_id_map [T, 2E+1]`` from :func:`token_dispatch`
    (with its ``pad_offsets`` when it padded); ``merging_probs [T,E]`` or ``[B,S,E]``. Returns ``[T,H]``."""
    inp, row_id_map = _mj._array(inp, "inp"), _mj._array(row_id_map, "row_id_map")
    if inp.ndim != 2:
        raise ValueError(f"inp: expected [rows, H], got shape {inp.shape}")
    if row_id_map.ndim != 2 or row_id_map.shape[1] % 2 != 1:
        raise ValueError(f"row_id_map: expected a mask map [T, 2E+1], got shape {row_id_map.shape}")
    T, E = row_id_map.shape[0], (row_id_map.shape[1] - 1) // 2
    mp = None
    if merging_probs is not None:
        mp = _mj._array(merging_probs, "merging_probs").reshape(-1, E)
        if mp.shape[0] != T:
            raise ValueError(f"merging_probs: expected [{T}, {E}], got {merging_probs.shape}")
    rows, experts, n = row_id_map[:, :E], row_id_map[:, E:2 * E], row_id_map[:, 2 * E:]
    valid = jnp.arange(E)[None, :] < n
    if pad_offsets is not None:
        pad_offsets = _mj._array(pad_offsets, "pad_offsets")
        if pad_offsets.shape != (E,):
            raise ValueError(f"pad_offsets: expected shape ({E},), got {pad_offsets.shape}")
        rows = rows + pad_offsets.astype(rows.dtype)[jnp.where(valid, experts, 0)]
    col = jnp.where(valid, experts, E)
    dst = jnp.full((T, E + 1), -1, jnp.int32)
    dst = dst.at[jnp.arange(T)[:, None], col].set(jnp.where(valid, rows, -1).astype(jnp.int32))[:, :E]
    return _mj.combine(inp, _plan_of_dst(dst, inp.shape[0], E), mp)


def sort_chunks_by_index(inp, split_sizes, sorted_indices):
    """Reorder chunks of rows: ``inp``'s rows split by ``split_sizes``, put in the order ``sorted_indices``.
    Returns ``(output [T,H], row_id_map [T] int32)`` with ``row_id_map[src] = dst`` (rows beyond
    ``sum(split_sizes)`` map to themselves). The gradient flows to ``inp``."""
    inp = _mj._array(inp, "inp")
    out = _mj.sort_chunks(inp, split_sizes, sorted_indices)
    s = jnp.asarray(split_sizes).astype(jnp.int32).reshape(-1)
    o = jnp.asarray(sorted_indices).astype(jnp.int32).reshape(-1)
    in_end = jnp.cumsum(s)
    in_start = in_end - s
    sorted_sizes = s[o]
    out_start = jnp.zeros_like(s).at[o].set(jnp.cumsum(sorted_sizes) - sorted_sizes)
    i = jnp.arange(inp.shape[0], dtype=jnp.int32)
    c = jnp.clip(jnp.searchsorted(in_end, i, side="right"), 0, max(s.shape[0] - 1, 0))
    inside = i < (in_end[-1] if s.shape[0] else 0)
    row_id_map = jnp.where(inside, out_start[c] + i - in_start[c], i) if s.shape[0] else i
    return out, row_id_map.astype(jnp.int32)
