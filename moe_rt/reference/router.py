"""NumPy oracle of the router ops (docs/router.md §1-§5), fp32 math.

Conventions shared with the CUDA kernels:

- Selection order is (value desc, index asc) on an order-preserving uint32 key of the fp32 value:
  -0.0 < +0.0, -inf is the smallest real value, and every NaN is larger than +inf (all NaNs equal, so
  NaNs are taken lowest index first).
- Grouped top-k: a group's score is the sum, in fp32 and in descending order, of its top-(k/g) selection
  scores; the g best groups are kept (same key order); experts of other groups rank below every real
  value.
- The expert bias affects selection only; the kept value is TE's revert fl(fl(a + b) - b).
- eps = 1e-20; softplus threshold 20; pre-softmax has no renormalization; post-softmax intermediate is
  -inf off the selection; sqrtsoftplus saves the raw logits.
"""
from __future__ import annotations

import numpy as np

EPS = np.float32(1e-20)
F32 = np.float32
SCORE_FUNCTIONS = ("sigmoid", "softmax", "sqrtsoftplus")


def float_keys(x) -> np.ndarray:
    """Order-preserving uint32 keys of fp32 values (NaN -> 0xFFFFFFFF)."""
    x = np.ascontiguousarray(x, dtype=F32)
    b = x.view(np.uint32)
    k = np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000)).astype(np.uint32)
    return np.where(np.isnan(x), np.uint32(0xFFFFFFFF), k).astype(np.uint32)


def select_topk(keys: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the k first elements of each row in the order (key desc, index asc)."""
    order = np.argsort(~keys, axis=-1, kind="stable")[..., :k]
    mask = np.zeros(keys.shape, dtype=bool)
    np.put_along_axis(mask, order, True, axis=-1)
    return mask


def _sigmoid(x):
    return (F32(1) / (F32(1) + np.exp(-x))).astype(F32)


def _sqrtsoftplus(x):
    with np.errstate(over="ignore"):
        sp = np.log1p(np.exp(np.minimum(x, F32(20)))).astype(F32)
    return np.where(x > 20, np.sqrt(x), np.sqrt(sp)).astype(F32)


def _softmax(x):
    with np.errstate(invalid="ignore"):
        m = np.max(x, axis=-1, keepdims=True)
        ex = np.exp(x - m).astype(F32)
        s = np.sum(ex, axis=-1, keepdims=True, dtype=F32)
        return (ex * (F32(1) / s)).astype(F32)


def group_limited_mask(r: np.ndarray, topk: int, num_groups: int, group_topk: int) -> np.ndarray:
    """Mask of the experts in the chosen groups (docs/router.md §2) for selection scores r [T, E] (fp32)."""
    T, E = r.shape
    n, m = E // num_groups, topk // group_topk
    rg = r.reshape(T, num_groups, n)
    order = np.argsort(~float_keys(rg), axis=-1, kind="stable")[..., :m]
    vals = np.take_along_axis(rg, order, axis=-1)
    s = vals[..., 0].astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        for u in range(1, m):
            s = (s + vals[..., u]).astype(F32)
    gsel = select_topk(float_keys(s), group_topk)
    return np.repeat(gsel, n, axis=-1)


def _selection(r, topk, num_groups, group_topk):
    keys = float_keys(r)
    if group_topk is not None and group_topk < num_groups:
        keys = np.where(group_limited_mask(r, topk, num_groups, group_topk), keys, np.uint32(0))
    return select_topk(keys, topk)


def topk_with_score_fwd_fp32(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                             scaling_factor=None, score_function="softmax", expert_bias=None):
    """Like :func:`topk_with_score_fwd` but probs stay fp32 (these are the compact form's weights)."""
    x = np.asarray(logits).astype(F32)
    E = x.shape[-1]
    x = x.reshape(-1, E)
    s = F32(1.0 if scaling_factor is None else scaling_factor)
    b = None if expert_bias is None else np.asarray(expert_bias).astype(F32).reshape(1, E)
    with np.errstate(invalid="ignore", over="ignore"):
        if score_function in ("sigmoid", "sqrtsoftplus"):
            a = _sigmoid(x) if score_function == "sigmoid" else _sqrtsoftplus(x)
            inter = a if score_function == "sigmoid" else x.copy()
            r = (a + b).astype(F32) if b is not None else a
            sel = _selection(r, topk, num_groups, group_topk)
            pt = (r - b).astype(F32) if b is not None else r
            pt = np.where(sel, pt, F32(0))
            if topk > 1:
                den = (np.sum(pt, axis=-1, keepdims=True, dtype=F32) + EPS).astype(F32)
                p = (pt / den).astype(F32)
            else:
                p = pt
            probs = np.where(sel, (s * p).astype(F32), F32(0))
        elif score_function == "softmax":
            if use_pre_softmax:
                a = _softmax(x)
                sel = _selection(a, topk, num_groups, group_topk)
                probs = np.where(sel, (s * a).astype(F32), F32(0))
                inter = a
            else:
                sel = _selection(x, topk, num_groups, group_topk)
                xs = np.where(sel, x, F32(-np.inf))
                p = _softmax(xs)
                p = np.where(sel, p, F32(0))
                probs = np.where(sel, (s * p).astype(F32), F32(0))
                inter = np.where(sel, p, F32(-np.inf)).astype(F32)
        else:
            raise ValueError(f"score_function: unknown {score_function!r}")
    return probs.astype(F32), sel, inter.astype(F32)


def topk_with_score_fwd(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                        scaling_factor=None, score_function="softmax", expert_bias=None):
    """(probs [T,E] logits dtype, routing_map [T,E] bool, intermediate [T,E] fp32) for logits [T,E]."""
    logits = np.asarray(logits)
    probs, sel, inter = topk_with_score_fwd_fp32(logits, topk, use_pre_softmax, num_groups, group_topk,
                                                 scaling_factor, score_function, expert_bias)
    return probs.astype(logits.dtype), sel, inter


def topk_indices_fwd(logits, topk, **kw):
    """(topk_idx [T,K] int32 ascending expert id, topk_weights [T,K] fp32)."""
    probs, sel, _ = topk_with_score_fwd_fp32(logits, topk, **kw)
    idx = np.argsort(~sel, axis=-1, kind="stable")[..., :topk]
    idx = np.sort(idx, axis=-1)
    return idx.astype(np.int32), np.take_along_axis(probs, idx, axis=-1).astype(F32)


def topk_with_score_bwd(grad_probs, routing_map, intermediate, topk, use_pre_softmax=False,
                        scaling_factor=None, score_function="softmax"):
    """grad_logits [T,E] (grad_probs dtype), docs/router.md §3."""
    grad_probs = np.asarray(grad_probs)
    s = F32(1.0 if scaling_factor is None else scaling_factor)
    g = (s * grad_probs.astype(F32)).astype(F32)
    msk = np.asarray(routing_map).astype(bool)
    y = np.asarray(intermediate).astype(F32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if score_function in ("sigmoid", "sqrtsoftplus"):
            v = y if score_function == "sigmoid" else _sqrtsoftplus(y)
            if topk > 1:
                A = (np.sum(np.where(msk, v, F32(0)), axis=-1, keepdims=True, dtype=F32) + EPS).astype(F32)
                B = np.sum(np.where(msk, g * v, F32(0)), axis=-1, keepdims=True, dtype=F32)
                gh = (g / A - B / (A * A)).astype(F32)
            else:
                gh = g
            gh = np.where(msk, gh, F32(0))
            if score_function == "sigmoid":
                dx = gh * y * (F32(1) - y)
            else:
                dx = np.where(y > 20, gh / (F32(2) * v + EPS), gh * _sigmoid(y) / (F32(2) * v + EPS))
            dx = np.where(msk, dx, F32(0))
        elif score_function == "softmax":
            D = np.sum(np.where(msk, g * y, F32(0)), axis=-1, keepdims=True, dtype=F32)
            if use_pre_softmax:
                dx = y * (np.where(msk, g, F32(0)) - D)
            else:
                dx = np.where(msk, y * (g - D), F32(0))
        else:
            raise ValueError(f"score_function: unknown {score_function!r}")
    return dx.astype(F32).astype(grad_probs.dtype)


def pack_bitmap(routing_map) -> np.ndarray:
    """The bit-packed routing map: uint8 [..., ceil(E/8)], bit e % 8 of byte e // 8 set where the map routes
    to e (LSB first, ``np.packbits(m, axis=-1, bitorder="little")``), padding bits 0."""
    return np.packbits(np.asarray(routing_map).astype(bool), axis=-1, bitorder="little")


def unpack_bitmap(bitmap, num_experts: int) -> np.ndarray:
    """The bool [..., E] map of a bit-packed one (padding bits ignored)."""
    return np.unpackbits(np.asarray(bitmap, dtype=np.uint8), axis=-1, count=num_experts,
                         bitorder="little").astype(bool)


def map_to_indices(routing_map, topk: int) -> np.ndarray:
    """The selected experts of each row of a bool map, in ascending expert id: int64 [..., topk]."""
    m = np.asarray(routing_map).astype(bool)
    idx = np.argsort(~m, axis=-1, kind="stable")[..., :topk]
    return np.sort(idx, axis=-1).astype(np.int64)


def topk_with_score_bwd_indices(grad_probs, topk_indices, intermediate, topk, use_pre_softmax=False,
                                scaling_factor=None, score_function="softmax"):
    """grad_logits [T,E] (grad_probs dtype) from the dense indices [T,K] (any order; -1: no expert) and the
    fp32 intermediate: the sums run over the K entries of each row in row order, in fp32; the row is zero
    (pre-softmax: y * (0 - sum)) except at the selected experts. Equal to :func:`topk_with_score_bwd` up to
    the order of the sums."""
    grad_probs = np.asarray(grad_probs)
    s = F32(1.0 if scaling_factor is None else scaling_factor)
    g = (s * grad_probs.astype(F32)).astype(F32)
    y = np.asarray(intermediate).astype(F32)
    idx = np.asarray(topk_indices).astype(np.int64)
    T, E = g.shape
    valid = idx >= 0
    e = np.where(valid, idx, 0)
    gs = np.take_along_axis(g, e, axis=-1)
    ys = np.take_along_axis(y, e, axis=-1)
    sig_like = score_function in ("sigmoid", "sqrtsoftplus")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function: unknown {score_function!r}")
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        vs = ys if score_function != "sqrtsoftplus" else _sqrtsoftplus(ys)
        A = np.zeros((T, 1), F32)
        B = np.zeros((T, 1), F32)
        for k in range(idx.shape[-1]):
            on = valid[:, k:k + 1]
            if sig_like:
                A = np.where(on, (A + vs[:, k:k + 1]).astype(F32), A)
                B = np.where(on, (B + gs[:, k:k + 1] * vs[:, k:k + 1]).astype(F32), B)
            else:
                A = np.where(on, (A + gs[:, k:k + 1] * ys[:, k:k + 1]).astype(F32), A)
        if sig_like:
            Ae = (A + EPS).astype(F32)
            gh = (gs / Ae - B / (Ae * Ae)).astype(F32) if topk > 1 else gs
            if score_function == "sigmoid":
                dsel = gh * ys * (F32(1) - ys)
            else:
                dsel = np.where(ys > 20, gh / (F32(2) * vs + EPS), gh * _sigmoid(ys) / (F32(2) * vs + EPS))
            out = np.zeros((T, E), F32)
        else:
            dsel = ys * (gs - A)
            out = (y * (F32(0) - A)).astype(F32) if use_pre_softmax else np.zeros((T, E), F32)
    rows = np.broadcast_to(np.arange(T)[:, None], idx.shape)
    out[rows[valid], idx[valid]] = dsel.astype(F32)[valid]
    return out.astype(grad_probs.dtype)


def scores_for_aux_loss_fwd(logits, topk, score_function):
    """(scores [T,E] fp32, routing_map [T,E] bool, intermediate [T,E] fp32), docs/router.md §4."""
    x = np.asarray(logits).astype(F32)
    x = x.reshape(-1, x.shape[-1])
    with np.errstate(invalid="ignore", over="ignore"):
        if score_function == "softmax":
            a = _softmax(x)
            inter = a
        elif score_function in ("sigmoid", "sqrtsoftplus"):
            v = _sigmoid(x) if score_function == "sigmoid" else _sqrtsoftplus(x)
            a = (v / (np.sum(v, axis=-1, keepdims=True, dtype=F32) + EPS)).astype(F32)
            inter = v if score_function == "sigmoid" else x.copy()
        else:
            raise ValueError(f"score_function: unknown {score_function!r}")
    return a.astype(F32), select_topk(float_keys(a), topk), inter.astype(F32)


def scores_for_aux_loss_bwd(grad_scores, intermediate, topk, score_function):
    """grad_logits [T,E] fp32 (callers cast to the logits dtype), docs/router.md §4."""
    g = np.asarray(grad_scores).astype(F32)
    y = np.asarray(intermediate).astype(F32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if score_function == "softmax":
            D = np.sum(g * y, axis=-1, keepdims=True, dtype=F32)
            dx = y * (g - D)
        else:
            v = y if score_function == "sigmoid" else _sqrtsoftplus(y)
            A = (np.sum(v, axis=-1, keepdims=True, dtype=F32) + EPS).astype(F32)
            B = np.sum(g * v, axis=-1, keepdims=True, dtype=F32)
            gh = (g / A - B / (A * A)).astype(F32)
            if score_function == "sigmoid":
                dx = gh * y * (F32(1) - y)
            else:
                dx = np.where(y > 20, gh / (F32(2) * v + EPS), gh * _sigmoid(y) / (F32(2) * v + EPS))
    return dx.astype(F32)


def aux_loss_coeff(total_num_tokens, num_experts, topk, coeff) -> np.float32:
    """C_coeff = (E * coeff) / topk / T_tot / T_tot, sequential fp32 divisions (docs/router.md §5).
    ``total_num_tokens``: an int or a one-element int array (not checked: T <= 0 gives inf/NaN); None stops
    before the divisions by T."""
    c = F32(num_experts) * F32(coeff)
    c = F32(c / F32(topk))
    if total_num_tokens is None:
        return c
    t = F32(np.asarray(total_num_tokens).reshape(-1)[0])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        c = F32(c / t)
        return F32(c / t)


def aux_loss_fwd(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    """0-d aux loss in the probs dtype: C_coeff * sum_c tpe[c] * sum_r probs[r, c]."""
    probs = np.asarray(probs)
    col = np.sum(probs.astype(F32), axis=0, dtype=F32)
    tpe = np.asarray(tokens_per_expert).astype(F32)
    tot = np.sum((tpe * col).astype(F32), dtype=F32)
    c = aux_loss_coeff(total_num_tokens, num_experts, topk, coeff)
    return np.asarray(F32(c * tot)).astype(probs.dtype)


def aux_loss_bwd(grad_aux_loss, num_rows, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    """grad_probs [num_rows, C] in the grad dtype: (C_coeff * tpe[c]) * grad."""
    grad = np.asarray(grad_aux_loss)
    g = F32(grad.astype(F32).reshape(-1)[0])
    tpe = np.asarray(tokens_per_expert).astype(F32)
    c = aux_loss_coeff(total_num_tokens, num_experts, topk, coeff)
    row = ((c * tpe).astype(F32) * g).astype(F32)
    return np.broadcast_to(row, (num_rows, tpe.shape[0])).astype(grad.dtype)


# ---- Quantile Balancing ------------------------------------------------------------------------------

def topk_with_score_qb_fwd(logits, topk, expert_bias, scaling_factor=None):
    """(probs, routing_map, intermediate, cutoff [T] fp32) of the QB forward (docs/router.md "Quantile
    Balancing"): sigmoid + bias, the top topk + 1 in the order (key desc, index asc), the last of them the
    cutoff (its biased score), the other topk routed exactly as :func:`topk_with_score_fwd` routes them."""
    probs, sel, inter = topk_with_score_fwd(logits, topk, scaling_factor=scaling_factor, score_function="sigmoid",
                                            expert_bias=expert_bias)
    b = np.asarray(expert_bias).astype(F32).reshape(1, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        r = (inter + b).astype(F32)
    last = np.argsort(~float_keys(r), axis=-1, kind="stable")[:, topk:topk + 1]
    return probs, sel, inter, np.take_along_axis(r, last, axis=-1)[:, 0].astype(F32)


def qb_bins(raw, cutoff, lower, upper, num_bins):
    """int64 [T, E] bins of r = cutoff[t] - raw[t, e]: clamp(floor((r - lower) * (B / (upper - lower))), 0,
    B - 1), every step in fp32; a NaN lands in bin 0 (fmax/fmin keep the number)."""
    lo, hi = F32(lower), F32(upper)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        sc = F32(F32(num_bins) / F32(hi - lo))
        r = (np.asarray(cutoff, F32).reshape(-1, 1) - np.asarray(raw, F32)).astype(F32)
        v = np.floor(((r - lo).astype(F32) * sc).astype(F32))
    return np.fmin(np.fmax(v, F32(0)), F32(num_bins - 1)).astype(np.int64)


def qb_histogram_accumulate(raw, cutoff, bounds, hist):
    """hist [E, B] int32 += the counts of :func:`qb_bins` per (expert, bin), in place (int32 wraps, as the
    device's atomics do)."""
    E, B = hist.shape
    raw = np.asarray(raw, F32).reshape(-1, E)
    bounds = np.asarray(bounds, F32).reshape(2)
    bins = qb_bins(raw, cutoff, bounds[0], bounds[1], B)
    flat = (np.arange(E, dtype=np.int64)[None, :] * B + bins).reshape(-1)
    counts = np.bincount(flat, minlength=E * B).reshape(E, B)
    np.add(hist, counts.astype(np.int32), out=hist, casting="unsafe")


def expert_bias_from_quantile(xp, hist, bounds, bias, topk):
    """(new bias [..., E], new bounds [..., 2]) in float64 from QB histograms [..., E, B] (Megatron's
    ``get_updated_expert_bias_with_quantile``; :func:`moe_rt.router.update_expert_bias_with_quantile` states
    the steps). ``xp``: numpy or cupy (array ops only: no host read)."""
    h = hist.astype(xp.int64)
    E, B = int(h.shape[-2]), int(h.shape[-1])
    C = xp.cumsum(h, axis=-1)
    N = C[..., 0:1, B - 1:B].astype(xp.float64)  # [..., 1, 1]: the tokens counted (expert 0's total)
    target = N * topk / E
    rank = xp.maximum(1.0, xp.ceil(target))
    reach = C >= rank
    j = xp.where(reach.any(axis=-1), xp.argmax(reach.astype(xp.int8), axis=-1), B - 1)[..., None]  # [..., E, 1]
    before = xp.where(j > 0, xp.take_along_axis(C, xp.maximum(j - 1, 0), axis=-1), 0).astype(xp.float64)
    hj = xp.take_along_axis(h, j, axis=-1).astype(xp.float64)
    frac = xp.clip((target - before) / xp.maximum(hj, 1.0), 0.0, 1.0)
    bd = bounds.astype(xp.float64)
    lo, hi = bd[..., 0:1], bd[..., 1:2]  # [..., 1]
    b = lo + ((j[..., 0] + frac[..., 0]) * (hi - lo)) / B  # [..., E]
    b = b - b.mean(axis=-1, keepdims=True)
    nb = xp.concatenate([b.min(axis=-1, keepdims=True) - 1.0, b.max(axis=-1, keepdims=True) + 1.0], axis=-1)
    keep = N[..., 0] == 0  # [..., 1]
    return xp.where(keep, bias.astype(xp.float64), b), xp.where(keep, bd, nb)
