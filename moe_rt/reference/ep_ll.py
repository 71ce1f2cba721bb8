"""NumPy oracle of the low-latency expert-parallel mode (docs/ep.md §8; :mod:`moe_rt.ep_ll`): R ranks
simulated in one process. Every function takes *lists* with one entry per rank and returns lists.

Semantics (the same as :class:`moe_rt.ep_ll.LowLatencyGroup` on the GPU, bit for bit except where noted):

- ``E`` experts over ``R`` ranks, ``L = E // R`` local experts (expert ``e`` on rank ``e // L`` as local
  expert ``e % L``); ``Tmax = max_tokens_per_rank``; each rank has ``T_s <= Tmax`` tokens, ``K`` the same on
  every rank. Ids must be in ``[-1, E)`` (``-1`` = no expert).
- **Fixed slots.** Token ``t`` of source rank ``s`` for local expert ``l`` of rank ``d`` has the slot ``(l,
  s*Tmax + t)`` of rank ``d``'s receive buffer ``[L, R*Tmax, H]``; nothing is counted, so nothing can
  overflow. ``kf(t, k)``: the first ``k' <= k`` with the same expert as ``k`` (a token that names one expert
  twice has one slot for it).
- **dispatch**: ``recv_x[d][l, s*Tmax + t] = x[s][t]`` for every valid slot; the other rows are zero here (on
  the GPU they are left as they were: unspecified). ``slot_k[d][l, j]`` = the first ``k`` of the slot's
  token with that expert, or ``-1`` (the validity mask is ``slot_k >= 0``); ``slot_w`` = the fp32 sum of the
  weights of those ``k`` (ascending), 0 when invalid; ``counts[d][l]`` = the valid slots of ``l`` (int32).
- **dispatch_fp8**: the same slots with FP8 rows: a float ``x`` is quantized per rank first
  (:func:`moe_rt.reference.fp8.quantize_fp8`, block 128, bit for bit the kernel's rule), or a pre-quantized
  ``(x_fp8, scales)`` pair is taken as is; ``recv_q[d][l, s*Tmax + t]`` = the token's e4m3 codes and
  ``recv_s[d][l, s*Tmax + t]`` its ``ceil(H/128)`` fp32 scales; the handle is ``dispatch``'s (the backward and
  combine are the float ones). Rows of invalid slots are zero here (unspecified on the GPU).
- **combine**: ``out[t] = sum over k ascending (e = idx[t,k] >= 0) of w[t,k] * y[d][l, me*Tmax + t]`` in fp32,
  each product and each addition rounded to fp32, then one rounding to ``y``'s dtype.
- **combine_partials** (a group made with ``combine_partials=True``): each expert rank ``d`` makes, for each
  token ``t`` of owner ``s`` with slots there, the partial ``z = sum over those slots in k ascending order
  (each at its first k) of slot_w[d][l, s*Tmax + t] * y[d][l, s*Tmax + t]`` in fp32 (each product and each
  addition rounded to fp32, from 0), rounded to ``y``'s dtype; ``out[t]`` = the fp32 sum of the partials of
  the distinct ranks of the token's experts, ranks ascending (from 0), rounded once to ``y``'s dtype.
- **dispatch_bwd**: ``grad_x[t] = sum over the k with kf(t,k) == k`` (ascending) of ``g[d][l, slot]`` (fp32
  additions, one final rounding); ``grad_w[t,k] = grad_slot_w[d][l, slot]`` for ``e >= 0``, else 0.
- **combine_bwd**: ``grad_y[d][l, slot] = round(slot_w * g[t])`` (fp32 product), zero at invalid slots;
  ``grad_w[t,k] = <y[d][l, slot], g[t]>`` (fp32; float64 here, a tolerance against the GPU's fp32 order).
"""
from __future__ import annotations

import numpy as np

MAX_TOKENS_PER_RANK = 1024


def _check_list(name, arrs, R):
    if not isinstance(arrs, (list, tuple)) or len(arrs) != R:
        raise ValueError(f"{name}: expected a list of {R} arrays (one per rank)")


def first_k(idx: np.ndarray) -> np.ndarray:
    """``kf [T,K]``: for each slot the first k of its row with the same expert (itself for ``-1``)."""
    T, K = idx.shape
    kf = np.tile(np.arange(K), (T, 1))
    for k in range(K - 1, -1, -1):  # descending: the smallest k wins
        for k2 in range(k + 1, K):
            same = idx[:, k2] == idx[:, k]
            kf[same, k2] = k
    return kf


def dispatch(x, topk_idx, topk_weights, num_experts: int, max_tokens_per_rank: int):
    """Every rank's ``(recv_x [L,R*Tmax,H], counts [L] int32, handle dict)``."""
    R = len(x)
    _check_list("topk_idx", topk_idx, R)
    _check_list("topk_weights", topk_weights, R)
    if R < 1 or num_experts % R:
        raise ValueError(f"num_experts={num_experts} must be a multiple of the {R} ranks")
    L, Tmax = num_experts // R, int(max_tokens_per_rank)
    xs = [np.asarray(a) for a in x]
    H, dtype = xs[0].shape[1], xs[0].dtype
    idxs, ws, K = [], [], None
    for s in range(R):
        a = np.asarray(topk_idx[s])
        if a.ndim != 2 or (K is not None and a.shape[1] != K):
            raise ValueError(f"topk_idx[{s}]: expected [T, K] with one K on every rank, got shape {a.shape}")
        K = a.shape[1]
        if a.shape[0] > Tmax:
            raise ValueError(f"topk_idx[{s}]: T={a.shape[0]} exceeds max_tokens_per_rank={Tmax}")
        if a.size and (a.min() < -1 or a.max() >= num_experts):
            bad = a[(a < -1) | (a >= num_experts)][0]
            raise ValueError(f"topk_idx[{s}]: expert ids must be in [-1, num_experts={num_experts}), got {int(bad)}")
        if xs[s].shape != (a.shape[0], H):
            raise ValueError(f"x[{s}]: expected shape {(a.shape[0], H)}, got {xs[s].shape}")
        idxs.append(a.astype(np.int64))
        ws.append(np.asarray(topk_weights[s], np.float32).reshape(a.shape))
    RT = R * Tmax
    out = []
    for d in range(R):
        recv = np.zeros((L, RT, H), dtype)
        slot_k = np.full((L, RT), -1, np.int32)
        slot_w = np.zeros((L, RT), np.float32)
        route = np.full((R, Tmax, K), -1, np.int32)
        for s in range(R):
            a, w = idxs[s], ws[s]
            for t in range(a.shape[0]):
                for k in range(K):
                    e = int(a[t, k])
                    if e < 0 or e // L != d:
                        continue
                    l, j = e % L, s * Tmax + t
                    route[s, t, k] = l
                    if slot_k[l, j] < 0:
                        slot_k[l, j] = k
                        recv[l, j] = xs[s][t]
                    slot_w[l, j] = np.float32(slot_w[l, j] + w[t, k])
        counts = (slot_k >= 0).sum(axis=1).astype(np.int32)
        h = dict(rank=d, R=R, L=L, Tmax=Tmax, K=K, H=H, dtype=dtype, T=idxs[d].shape[0], idx=idxs[d],
                 w=ws[d], route=route, slot_k=slot_k, slot_w=slot_w, counts=counts)
        out.append((recv, counts, h))
    return out


FP8_BLOCK = 128


def dispatch_fp8(x, topk_idx, topk_weights, num_experts: int, max_tokens_per_rank: int, scales=None):
    """Every rank's ``(recv_q [L,R*Tmax,H], recv_s [L,R*Tmax,ceil(H/128)] float32, counts [L] int32, handle)``.

    ``x``: per rank a float ``[T,H]`` (quantized here, :func:`moe_rt.reference.fp8.quantize_fp8`), or with
    ``scales`` (per rank ``[T, ceil(H/128)]`` float32) the e4m3 codes ``[T,H]`` (float8_e4m3fn or uint8),
    which ``recv_q`` keeps the dtype of."""
    from moe_rt.reference import fp8 as _fp8

    R = len(x)
    if scales is None:
        pairs = [_fp8.quantize_fp8(np.asarray(a), FP8_BLOCK) for a in x]
        x, scales = [q for q, _ in pairs], [sc for _, sc in pairs]
    _check_list("scales", scales, R)
    rows = dispatch(x, topk_idx, topk_weights, num_experts, max_tokens_per_rank)
    srows = dispatch([np.asarray(sc, np.float32) for sc in scales], topk_idx, topk_weights, num_experts,
                     max_tokens_per_rank)
    return [(q, sc, counts, h) for (q, counts, h), (sc, _, _) in zip(rows, srows)]


def _routed(h):
    """``(t, k, d, l, j)`` for every valid slot of the owner ``h``: expert rank d, local expert l, slot column j."""
    L, Tmax = h["L"], h["Tmax"]
    for t in range(h["T"]):
        for k in range(h["K"]):
            e = int(h["idx"][t, k])
            if e >= 0:
                yield t, k, e // L, e % L, h["rank"] * Tmax + t


def combine(handles, expert_out):
    """Every rank's ``out [T,H]`` in ``expert_out``'s dtype."""
    R = len(handles)
    _check_list("expert_out", expert_out, R)
    ys = [np.asarray(y) for y in expert_out]
    res = []
    for h in handles:
        acc = np.zeros((h["T"], ys[0].shape[2]), np.float32)
        for t, k, d, l, j in _routed(h):
            acc[t] = acc[t] + np.float32(h["w"][t, k]) * ys[d][l, j].astype(np.float32)
        res.append(acc.astype(ys[0].dtype))
    return res


def combine_partials(handles, expert_out):
    """Every rank's ``out [T,H]`` in ``expert_out``'s dtype through rank partials (module notes): the slot
    weights are each expert rank's ``slot_w`` (its dispatch's fp32 sums of duplicate weights)."""
    R = len(handles)
    _check_list("expert_out", expert_out, R)
    ys = [np.asarray(y) for y in expert_out]
    dtype, H = ys[0].dtype, ys[0].shape[2]
    res = []
    for h in handles:
        kf = first_k(h["idx"])
        parts = {}  # (t, d) -> the fp32 partial of rank d for token t, before its rounding
        for t, k, d, l, j in _routed(h):
            if kf[t, k] != k:
                continue
            z = parts.get((t, d), np.zeros(H, np.float32))
            parts[(t, d)] = z + np.float32(handles[d]["slot_w"][l, j]) * ys[d][l, j].astype(np.float32)
        acc = np.zeros((h["T"], H), np.float32)
        for t, d in sorted(parts):  # tokens, then ranks ascending
            acc[t] = acc[t] + parts[(t, d)].astype(dtype).astype(np.float32)
        res.append(acc.astype(dtype))
    return res


def dispatch_bwd(handles, grad_recv_x, grad_recv_weights=None):
    """Every rank's ``(grad_x [T,H], grad_topk_weights [T,K] fp32 or None)``."""
    R = len(handles)
    _check_list("grad_recv_x", grad_recv_x, R)
    gs = [np.asarray(g) for g in grad_recv_x]
    gws = None if grad_recv_weights is None else [np.asarray(g, np.float32) for g in grad_recv_weights]
    res = []
    for h in handles:
        kf = first_k(h["idx"])
        acc = np.zeros((h["T"], gs[0].shape[2]), np.float32)
        gw = np.zeros((h["T"], h["K"]), np.float32) if gws is not None else None
        for t, k, d, l, j in _routed(h):
            if kf[t, k] == k:
                acc[t] = acc[t] + gs[d][l, j].astype(np.float32)
            if gw is not None:
                gw[t, k] = gws[d][l, j]
        res.append((acc.astype(gs[0].dtype), gw))
    return res


def combine_bwd(handles, grad_out, expert_out=None):
    """Every rank's ``(grad_expert_out [L,R*Tmax,H], grad_topk_weights [T,K] fp32 or None)``."""
    R = len(handles)
    _check_list("grad_out", grad_out, R)
    gs = [np.asarray(g) for g in grad_out]
    ys = None if expert_out is None else [np.asarray(y) for y in expert_out]
    res = []
    for d, h in enumerate(handles):
        L, Tmax, H = h["L"], h["Tmax"], gs[0].shape[1]
        gy = np.zeros((L, R * Tmax, H), gs[0].dtype)
        for l in range(L):
            for j in np.nonzero(h["slot_k"][l] >= 0)[0]:
                s, t = divmod(int(j), Tmax)
                gy[l, j] = (h["slot_w"][l, j] * gs[s][t].astype(np.float32)).astype(gs[0].dtype)
        gw = None
        if ys is not None:
            gw = np.zeros((h["T"], h["K"]), np.float32)
            for t, k, dd, l, j in _routed(h):
                gw[t, k] = np.dot(ys[dd][l, j].astype(np.float64), gs[d][t].astype(np.float64))
        res.append((gy, gw))
    return res
