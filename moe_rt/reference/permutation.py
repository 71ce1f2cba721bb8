"""NumPy oracle of the dispatch/combine (token permutation) family; docs/permutation.md §1
(the § marks below are its sections).

Layout (§1.2): permuted rows are grouped expert-major (expert id ascending) and, within an expert, by flat
slot index ``t*K + k`` ascending (a stable sort of the flat expert ids), hence token-ascending. Each expert
``e`` owns the segment ``[seg_start[e], seg_start[e+1])``; its first ``counts[e]`` rows are routed slots,
the rest (``align_size`` padding, §1.3) are zero rows. Rows ``[seg_start[E], num_rows)`` are unused tail rows,
also zero. Drops (§1.4): a slot whose id is ``-1`` (or out of ``[0, E)``) is dropped; with
``num_out_tokens`` only the first ``num_out_tokens`` routed slots in expert-major order are kept.

Reductions accumulate in float64 and cast once. Every function takes and returns NumPy arrays.
"""
from __future__ import annotations

import numpy as np


# -- static sizes --------------------------------------------------------------------------------------

def num_rows(num_tokens: int, topk: int, num_experts: int, align_size: int = 1,
             num_out_tokens: int | None = None) -> int:
    """Rows of the permuted buffer, known on the host without looking at the routing (§1.3).

    ``kept = num_tokens * topk`` (or ``num_out_tokens``); with ``align_size == 1`` that is the row count,
    else ``floor((kept + E*(A-1)) / A) * A``, a bound on ``sum(ceil(n_e / A) * A)`` that is a multiple of A.
    """
    kept = num_tokens * topk if num_out_tokens is None else int(num_out_tokens)
    if align_size == 1:
        return kept
    return (kept + num_experts * (align_size - 1)) // align_size * align_size


def routing_map_to_topk(routing_map: np.ndarray) -> np.ndarray:
    """``[T,E]`` bool map -> ``[T,E]`` int32 ids: slot ``k`` of token ``t`` is expert ``k`` if routed, else -1.

    A routing map is therefore a plan with ``topk == num_experts`` whose per-token slots are listed in
    ascending expert id; dense ``[T,E]`` probs are then exactly the ``[T,K]`` slot probs.
    """
    m = np.asarray(routing_map).astype(bool)
    E = m.shape[1]
    return np.where(m, np.arange(E, dtype=np.int32)[None, :], np.int32(-1)).astype(np.int32)


# -- plan ------------------------------------------------------------------------------------------------

def make_plan(topk_idx: np.ndarray, num_experts: int, align_size: int = 1,
              num_out_tokens: int | None = None) -> dict:
    """The plan of a ``[T,K]`` int routing (ids outside ``[0, E)`` are dropped).

    Returns a dict: ``dst_row [T,K] int32`` (-1 = no route / dropped), ``src_slot [N] int32`` (``t*K+k``;
    -1 = padding or unused), ``seg_start [E+1] int32``, ``counts [E] int32`` (kept routed slots per
    expert), ``tokens_per_expert [E] int32`` (padded counts when ``align_size > 1``, else ``counts``),
    and the ints ``num_tokens, topk, num_experts, num_rows, align_size``.
    """
    idx = np.asarray(topk_idx).astype(np.int64)
    T, K = idx.shape
    E, A = int(num_experts), int(align_size)
    N = num_rows(T, K, E, A, num_out_tokens)
    flat = idx.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    key = np.where(valid, flat, E)  # drops sort last
    order = np.argsort(key, kind="stable")
    n_valid = int(valid.sum())
    limit = n_valid if num_out_tokens is None else min(n_valid, int(num_out_tokens))
    kept_slots = order[:limit]
    counts = np.bincount(flat[kept_slots], minlength=E).astype(np.int64) if limit else np.zeros(E, np.int64)
    target = (counts + A - 1) // A * A
    seg_start = np.zeros(E + 1, np.int64)
    seg_start[1:] = np.cumsum(target)
    dst = np.full(T * K, -1, np.int64)
    src = np.full(N, -1, np.int64)
    unpadded_start = np.concatenate([[0], np.cumsum(counts)])
    e_of = flat[kept_slots]
    d = seg_start[e_of] + (np.arange(limit) - unpadded_start[e_of])
    dst[kept_slots] = d
    src[d] = kept_slots
    return {
        "dst_row": dst.reshape(T, K).astype(np.int32),
        "src_slot": src.astype(np.int32),
        "seg_start": seg_start.astype(np.int32),
        "counts": counts.astype(np.int32),
        "tokens_per_expert": (target if A > 1 else counts).astype(np.int32),
        "num_tokens": T, "topk": K, "num_experts": E, "num_rows": N, "align_size": A,
    }


# -- dispatch / combine ----------------------------------------------------------------------------------

def _slots(plan):
    dst = plan["dst_row"].reshape(-1).astype(np.int64)
    slots = np.nonzero(dst >= 0)[0]
    return slots, dst[slots]


def dispatch(x: np.ndarray, plan: dict, probs: np.ndarray | None = None, probs_dtype=None):
    """``x_p[dst(t,k)] = x[t]`` (pure copy, any dtype), pad/unused rows zero; ``probs_p[dst] = probs[t,k]``
    (``probs`` given as ``[T,K]``) in ``probs_dtype`` (None: float32). Returns ``(x_p [N,H], probs_p [N] or
    None)``."""
    K = plan["topk"]
    slots, rows = _slots(plan)
    x = np.asarray(x)
    out = np.zeros((plan["num_rows"],) + x.shape[1:], x.dtype)
    out[rows] = x[slots // K]
    pp = None
    if probs is not None:
        dt = np.dtype(np.float32 if probs_dtype is None else probs_dtype)
        pp = np.zeros(plan["num_rows"], dt)
        pp[rows] = np.asarray(probs).astype(np.float64 if dt == np.float64 else np.float32).reshape(-1)[slots]
    return out, pp


def combine(y_p: np.ndarray, plan: dict, probs: np.ndarray | None = None) -> np.ndarray:
    """``y[t] = sum_k w[t,k] * y_p[dst(t,k)]`` (k ascending, dropped slots skipped, w = 1 without probs),
    accumulated in float64 and cast to ``y_p.dtype``. Tokens with no route give zero rows."""
    T, K = plan["num_tokens"], plan["topk"]
    y_p = np.asarray(y_p)
    acc = np.zeros((T,) + y_p.shape[1:], np.float64)
    dst = plan["dst_row"]
    w = None if probs is None else np.asarray(probs, np.float32).astype(np.float64)
    for k in range(K):
        m = dst[:, k] >= 0
        rows = y_p[dst[m, k]].astype(np.float64)
        acc[m] += rows if w is None else w[m, k, None] * rows
    return acc.astype(y_p.dtype)


def dispatch_backward(grad_x_p: np.ndarray, plan: dict, grad_probs_p: np.ndarray | None = None):
    """VJP of :func:`dispatch`: ``grad_x = combine(grad_x_p, w=1)``; ``grad_probs[t,k] = grad_probs_p[dst]``
    (0 where dropped), float32 ``[T,K]``."""
    gx = combine(grad_x_p, plan, None)
    gp = None
    if grad_probs_p is not None:
        dst = plan["dst_row"]
        gpp = np.asarray(grad_probs_p, np.float32)
        gp = np.where(dst >= 0, gpp[np.maximum(dst, 0)] if gpp.size else 0, 0).astype(np.float32)
    return gx, gp


def combine_backward(grad_y: np.ndarray, plan: dict, y_p: np.ndarray, probs: np.ndarray | None = None):
    """VJP of :func:`combine`: ``grad_y_p[dst] = cast(float32(w) * float32(grad_y[t]))`` (pad rows zero);
    ``grad_probs[t,k] = sum_h y_p[dst,h] * grad_y[t,h]`` (float64 sum, float32 result, 0 where dropped)."""
    K = plan["topk"]
    g = np.asarray(grad_y)
    y_p = np.asarray(y_p)
    slots, rows = _slots(plan)
    gyp = np.zeros((plan["num_rows"],) + g.shape[1:], g.dtype)
    if probs is None:
        gyp[rows] = g[slots // K]
        return gyp, None
    w = np.asarray(probs, np.float32).reshape(-1)
    gyp[rows] = (w[slots, None] * g[slots // K].astype(np.float32)).astype(g.dtype)
    gp = np.zeros(plan["num_tokens"] * K, np.float64)
    gp[slots] = np.einsum("nh,nh->n", y_p[rows].astype(np.float64), g[slots // K].astype(np.float64))
    return gyp, gp.reshape(plan["num_tokens"], K).astype(np.float32)


# -- chunk sort (§1.7) ---------------------------------------------------------------------------------

def chunk_sort_map(num_rows_: int, split_sizes, sorted_indices) -> np.ndarray:
    """Destination row of every input row: chunks (sizes ``split_sizes``) are concatenated in the order
    ``sorted_indices``; rows at or beyond ``sum(split_sizes)`` map to themselves."""
    s = np.asarray(split_sizes, np.int64).reshape(-1)
    idx = np.asarray(sorted_indices, np.int64).reshape(-1)
    in_start = np.concatenate([[0], np.cumsum(s)])
    out_start = np.zeros(len(s), np.int64)
    out_start[idx] = np.concatenate([[0], np.cumsum(s[idx])])[:-1]
    dst = np.arange(num_rows_, dtype=np.int64)
    for c in range(len(s)):
        dst[in_start[c]:in_start[c + 1]] = out_start[c] + np.arange(s[c])
    return dst


def sort_chunks(x: np.ndarray, split_sizes, sorted_indices, probs=None):
    """``out[dst(i)] = x[i]`` (§1.7); with ``probs [N]`` also ``probs_out[dst(i)] = probs[i]``."""
    x = np.asarray(x)
    dst = chunk_sort_map(x.shape[0], split_sizes, sorted_indices)
    out = np.empty_like(x)
    out[dst] = x
    if probs is None:
        return out, None
    p = np.asarray(probs)
    po = np.empty_like(p)
    po[dst] = p
    return out, po


def sort_chunks_backward(grad_out: np.ndarray, split_sizes, sorted_indices, grad_probs=None):
    """VJP of :func:`sort_chunks`: ``grad_x[i] = grad_out[dst(i)]`` (the inverse permutation)."""
    g = np.asarray(grad_out)
    dst = chunk_sort_map(g.shape[0], split_sizes, sorted_indices)
    gp = None if grad_probs is None else np.asarray(grad_probs)[dst]
    return g[dst], gp
