"""NumPy oracle of expert parallelism (docs/ep.md §1-§4): R ranks simulated in one process.

Every function takes *lists* with one entry per rank (rank ``r`` is entry ``r``) and returns lists.

Semantics (the same as :mod:`moe_rt.ep` on the GPU):

- ``E`` experts over ``R`` ranks, ``L = E // R`` local experts; expert ``e`` lives on rank ``e // L`` with
  local id ``e % L``. Ids must be in ``[-1, E)`` (``-1`` = no expert); others raise ``ValueError`` here.
- Deduplicated transport: token ``t`` of rank ``s`` is sent **once** to every rank ``d`` holding at least one
  of its experts. ``send_list[s][d]`` is the ascending list of such tokens. With a per-pair capacity ``P``
  (capacity mode) only its first ``P`` entries are sent; the rest are dropped and flag an overflow on both
  ranks of the pair.
- Receive layout (rank ``d``): source-major, token ascending. Exact mode: segments packed back to back;
  capacity mode: source ``s`` owns rows ``[s*P, (s+1)*P)``, unused rows hold no routing.
- The received rows' local routing ``recv_local [rows, K]`` (local id or -1) is a routing for the
  permutation family's plan (:func:`moe_rt.reference.permutation.make_plan` with ``num_experts = L``):
  rows grouped by local expert, ``(src, t)`` ascending inside an expert, padding to ``align_size`` zero.
  Exact mode keeps every slot (``num_out_tokens`` = the slot count); capacity mode keeps the first
  ``capacity`` slots in expert-major order and flags an overflow when more arrived.
- dispatch: ``recv_x`` (expert-major ``[N,H]``), ``recv_weights [N]`` fp32, ``tokens_per_local_expert [L]``.
- combine: each rank reduces the local expert rows of every received token (weighted by its received
  weights, or not), accumulating in high precision and rounding once to ``y.dtype``: one partial row per
  (token, rank). The owner sums the partials in ascending rank order and rounds once.
- dispatch_bwd = the transpose of dispatch (an unweighted combine, plus the weight gradient gathered back to
  ``[T,K]``); combine_bwd = the transpose of combine (a dispatch of the gradient, times the weights when
  weighted, plus ``grad_recv_weights[n] = <y[n], grad_out[t]>``).
"""
from __future__ import annotations

import numpy as np

from moe_rt.reference import permutation as _perm


def _check_routing(topk_idx, num_experts):
    R = len(topk_idx)
    if R < 1:
        raise ValueError("topk_idx: expected one routing per rank, got an empty list")
    out = []
    K = None
    for r, idx in enumerate(topk_idx):
        a = np.asarray(idx)
        if a.ndim != 2:
            raise ValueError(f"topk_idx[{r}]: expected a 2-D array [T, K], got shape {a.shape}")
        if a.dtype not in (np.int32, np.int64):
            raise TypeError(f"topk_idx[{r}]: dtype must be int32 or int64, got {a.dtype.name}")
        if K is None:
            K = a.shape[1]
        elif a.shape[1] != K:
            raise ValueError(f"topk_idx[{r}]: every rank must use the same K={K}, got {a.shape[1]}")
        if a.size and (a.min() < -1 or a.max() >= num_experts):
            bad = a[(a < -1) | (a >= num_experts)][0]
            raise ValueError(f"topk_idx[{r}]: expert ids must be in [-1, num_experts={num_experts}), "
                             f"got {int(bad)}")
        out.append(a.astype(np.int64))
    return out, K


def send_lists(topk_idx, num_experts):
    """``lists[s][d]``: ascending tokens of rank ``s`` with at least one expert on rank ``d`` (pre-drop)."""
    idx, _ = _check_routing(topk_idx, num_experts)
    R = len(idx)
    L = num_experts // R
    lists = []
    for s in range(R):
        a = idx[s]
        dst = np.where(a >= 0, a // L, -1)
        lists.append([np.nonzero((dst == d).any(axis=1))[0].astype(np.int64) if a.shape[0] else
                      np.zeros(0, np.int64) for d in range(R)])
    return lists


def prepare(topk_idx, num_experts: int, *, align_size: int = 1, pair_capacity: int | None = None,
            capacity: int | None = None):
    """Plans of every rank. ``pair_capacity``/``capacity`` None = exact mode (nothing dropped).

    Returns a list of dicts (one per rank) with: ``rank, num_ranks, num_local_experts, topk, num_tokens``;
    ``send_tokens [R]`` (arrays of kept tokens per destination), ``send_counts [R]`` (pre-drop),
    ``recv_counts [R]`` (pre-drop), ``recv_offsets [R]`` (first row of each source segment),
    ``recv_src [rows]``, ``recv_tok [rows]`` (-1 = unused row), ``recv_local [rows, K]``,
    ``recv_weights_slots`` (None until dispatch), ``plan`` (the permutation plan dict),
    ``tokens_per_local_expert [L]``, ``num_rows`` (N), ``overflow`` (bool), ``mode``.
    """
    idx, K = _check_routing(topk_idx, num_experts)
    R = len(idx)
    if num_experts % R:
        raise ValueError(f"num_experts={num_experts} must be divisible by the number of ranks {R}")
    L = num_experts // R
    lists = send_lists(topk_idx, num_experts)
    capacity_mode = pair_capacity is not None or capacity is not None
    P = None
    if capacity_mode:
        P = int(pair_capacity) if pair_capacity is not None else max([a.shape[0] for a in idx] + [0])
    out = []
    for me in range(R):
        send_counts = np.array([len(lists[me][d]) for d in range(R)], np.int64)
        recv_counts = np.array([len(lists[s][me]) for s in range(R)], np.int64)
        kept = (lambda n: n) if P is None else (lambda n: min(n, P))
        send_tokens = [lists[me][d][:kept(len(lists[me][d]))] for d in range(R)]
        pair_over = P is not None and (bool((send_counts > P).any()) or bool((recv_counts > P).any()))
        if P is None:
            offs = np.concatenate([[0], np.cumsum(recv_counts)])
            rows = int(offs[-1])
        else:
            offs = np.arange(R + 1, dtype=np.int64) * P
            rows = R * P
        recv_src = np.full(rows, -1, np.int64)
        recv_tok = np.full(rows, -1, np.int64)
        recv_local = np.full((rows, K), -1, np.int64)
        for s in range(R):
            toks = lists[s][me][:kept(len(lists[s][me]))]
            o = int(offs[s])
            recv_src[o:o + len(toks)] = s
            recv_tok[o:o + len(toks)] = toks
            e = idx[s][toks] if len(toks) else np.zeros((0, K), np.int64)
            recv_local[o:o + len(toks)] = np.where((e >= 0) & (e // L == me), e % L, -1)
        total_slots = int((recv_local >= 0).sum())
        num_out = total_slots if capacity is None else int(capacity)
        expert_over = capacity is not None and total_slots > int(capacity)
        plan = _perm.make_plan(recv_local.astype(np.int32), L, align_size, num_out)
        out.append({
            "rank": me, "num_ranks": R, "num_experts": num_experts, "num_local_experts": L, "topk": K,
            "num_tokens": idx[me].shape[0], "topk_idx": idx[me],
            "mode": "capacity" if capacity_mode else "exact", "pair_capacity": P,
            "send_tokens": send_tokens, "send_counts": send_counts, "recv_counts": recv_counts,
            "recv_offsets": offs[:R].copy(), "recv_src": recv_src, "recv_tok": recv_tok,
            "recv_local": recv_local.astype(np.int32), "plan": plan, "num_rows": plan["num_rows"],
            "num_recv_rows": rows, "total_slots": total_slots,
            "tokens_per_local_expert": plan["tokens_per_expert"].copy(),
            "overflow": bool(pair_over or expert_over), "pair_overflow": bool(pair_over),
            "expert_overflow": bool(expert_over),
        })
    return out


def _gather_rows(handles, per_rank_src, fill_shape_of, dtype):
    """For every rank d: the [rows, ...] array whose row of (s, t) is ``per_rank_src[s][t]``."""
    res = []
    for h in handles:
        rows = h["num_recv_rows"]
        buf = np.zeros((rows,) + fill_shape_of, dtype)
        m = h["recv_tok"] >= 0
        for s in range(h["num_ranks"]):
            sel = m & (h["recv_src"] == s)
            if sel.any():
                buf[sel] = np.asarray(per_rank_src[s])[h["recv_tok"][sel]]
        res.append(buf)
    return res


def _check_list(name, arrs, R):
    if not isinstance(arrs, (list, tuple)) or len(arrs) != R:
        raise ValueError(f"{name}: expected a list of {R} per-rank arrays")


def dispatch(handles, x, topk_weights=None):
    """``x[r] [T_r,H]``, ``topk_weights[r] [T_r,K]`` (or None). Returns a list of
    ``(recv_x [N,H], recv_weights [N] fp32 or None, tokens_per_local_expert [L])``; also stores the received
    slot weights in each handle (``recv_weights_slots``) for weighted combine."""
    R = len(handles)
    _check_list("x", x, R)
    H = np.asarray(x[0]).shape[1]
    dt = np.asarray(x[0]).dtype
    recv = _gather_rows(handles, x, (H,), dt)
    recv_w = None
    if topk_weights is not None:
        _check_list("topk_weights", topk_weights, R)
        recv_w = _gather_rows(handles, [np.asarray(w, np.float32) for w in topk_weights],
                              (handles[0]["topk"],), np.float32)
    out = []
    for d, h in enumerate(handles):
        wk = None if recv_w is None else recv_w[d]
        h["recv_weights_slots"] = wk
        rx, rw = _perm.dispatch(recv[d], h["plan"], wk)
        out.append((rx, rw, h["tokens_per_local_expert"].copy()))
    return out


def dispatch_fp8(handles, x_fp8, scales, topk_weights=None):
    """FP8 rows and their scale rows through the same plans: ``x_fp8[r] [T_r,H]`` (float8_e4m3fn or uint8
    codes, moved bit for bit), ``scales[r] [T_r,S]`` fp32 (S = ceil(H/128) block scales), ``topk_weights`` as
    in :func:`dispatch`. Returns a list of ``(recv_x_fp8 [N,H], recv_scales [N,S], recv_weights [N] fp32 or
    None, tokens_per_local_expert [L])``: the scale rows land where their token's rows land, zero in padding
    rows (which dequantize to zero). Stores the received slot weights as :func:`dispatch` does."""
    R = len(handles)
    _check_list("scales", scales, R)
    rows = dispatch(handles, x_fp8, topk_weights)
    S = np.asarray(scales[0]).shape[1]
    recv_s = _gather_rows(handles, [np.asarray(s, np.float32) for s in scales], (S,), np.float32)
    return [(rx, _perm.dispatch(rs, h["plan"])[0], rw, tpe)
            for (rx, rw, tpe), rs, h in zip(rows, recv_s, handles)]


def _owner_sum(handles, partials, dtype, H):
    """out[s][t] = sum over ranks d ascending of partials[d][row of (s,t)], high precision, rounded once."""
    R = len(handles)
    outs = []
    for s in range(R):
        T = handles[s]["num_tokens"]
        acc = np.zeros((T, H), np.float64)
        for d in range(R):
            h = handles[d]
            sel = (h["recv_src"] == s) & (h["recv_tok"] >= 0)
            if sel.any():
                acc[h["recv_tok"][sel]] += partials[d][sel].astype(np.float64)
        outs.append(acc.astype(dtype))
    return outs


def combine(handles, y, *, weighted: bool = True):
    """``y[r] [N_r,H]`` -> ``out[r] [T_r,H]`` in ``y``'s dtype (see the module docstring)."""
    R = len(handles)
    _check_list("y", y, R)
    parts = []
    for d, h in enumerate(handles):
        w = None
        if weighted:
            w = h.get("recv_weights_slots")
            if w is None:
                raise ValueError("combine(weighted=True) needs the weights given to dispatch")
        parts.append(_perm.combine(np.asarray(y[d]), h["plan"], w))
    yd = np.asarray(y[0])
    return _owner_sum(handles, parts, yd.dtype, yd.shape[1])


def dispatch_bwd(handles, grad_recv_x, grad_recv_w=None):
    """Transpose of :func:`dispatch`: ``(grad_x [T,H], grad_w [T,K] fp32 or None)`` per rank."""
    R = len(handles)
    _check_list("grad_recv_x", grad_recv_x, R)
    parts, gps = [], []
    for d, h in enumerate(handles):
        gx, gp = _perm.dispatch_backward(np.asarray(grad_recv_x[d]), h["plan"],
                                         None if grad_recv_w is None else grad_recv_w[d])
        parts.append(gx)
        gps.append(gp)
    g0 = np.asarray(grad_recv_x[0])
    gx = _owner_sum(handles, parts, g0.dtype, g0.shape[1])
    if grad_recv_w is None:
        return [(g, None) for g in gx]
    out = []
    for s in range(R):
        hs = handles[s]
        idx = hs["topk_idx"]
        T, K = idx.shape
        L = hs["num_local_experts"]
        gw = np.zeros((T, K), np.float32)
        for d in range(R):
            h = handles[d]
            sel = (h["recv_src"] == s) & (h["recv_tok"] >= 0)
            rows = np.nonzero(sel)[0]
            toks = h["recv_tok"][rows]
            for k in range(K):
                m = (idx[toks, k] >= 0) & (idx[toks, k] // L == d)
                gw[toks[m], k] = gps[d][rows[m], k]
        out.append((gx[s], gw))
    return out


def combine_bwd(handles, grad_out, y=None, *, weighted: bool = True):
    """Transpose of :func:`combine`: ``(grad_y [N,H], grad_recv_w [N] fp32 or None)`` per rank;
    ``grad_recv_w`` needs ``y`` and ``weighted``."""
    R = len(handles)
    _check_list("grad_out", grad_out, R)
    g0 = np.asarray(grad_out[0])
    recv = _gather_rows(handles, grad_out, (g0.shape[1],), g0.dtype)
    out = []
    for d, h in enumerate(handles):
        plan = h["plan"]
        w = h.get("recv_weights_slots") if weighted else None
        if weighted and w is None:
            raise ValueError("combine_bwd(weighted=True) needs the weights given to dispatch")
        if w is None:
            gy, _ = _perm.combine_backward(recv[d], plan, None, None)
            out.append((gy, None))
            continue
        if y is None:
            xp, pp = _perm.dispatch(recv[d], plan, w)
            gy = (pp[:, None] * xp.astype(np.float32)).astype(g0.dtype)
            out.append((gy, None))
            continue
        gy, gp = _perm.combine_backward(recv[d], plan, np.asarray(y[d]), w)
        src = plan["src_slot"].astype(np.int64)
        gw = np.where(src >= 0, gp.reshape(-1)[np.maximum(src, 0)] if gp.size else 0, 0).astype(np.float32)
        out.append((gy, gw))
    return out


def wire_rows(handles):
    """Rows each rank sends over the network in dispatch (its own share excluded), per rank."""
    res = []
    for h in handles:
        me = h["rank"]
        if h["mode"] == "capacity":
            res.append((h["num_ranks"] - 1) * h["pair_capacity"])
        else:
            res.append(int(sum(len(h["send_tokens"][d]) for d in range(h["num_ranks"]) if d != me)))
    return res
