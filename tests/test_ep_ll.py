"""The low-latency EP mode (moe_rt/ep_ll.py): the NumPy R-rank reference against an independent vectorized
implementation at R = 1, 2, 4 (odd sizes, duplicate experts, -1 holes, T = 0 ranks, bf16), adjointness,
LowLatencyGroup's CPU path and its validation, the kernels' NVRTC compile, and the GPU tests (one GPU:
the 1-rank group against the reference, graph replay; several: tests/ep_ll_worker.py at 2 and 4 ranks)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import moe_rt
from moe_rt import _ep_direct
from moe_rt.ep_ll import LowLatencyGroup, LowLatencyHandle
from moe_rt.reference import ep_ll as ref

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "tools" / "launch.py"


def bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def make_case(rng, R, L, K, Ts, H, dtype=np.float32, dup=0.15, hole=0.15):
    """Every rank's (x [T,H], topk_idx [T,K] int64, topk_weights [T,K] fp32): distinct experts per token,
    then some slots repeat an earlier expert of the row (``dup``) or become -1 (``hole``)."""
    E = R * L
    xs, idxs, ws = [], [], []
    for T in Ts:
        idx = np.argsort(-rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
        for t in range(T):
            for k in range(1, K):
                if rng.random() < dup:
                    idx[t, k] = idx[t, rng.integers(0, k)]
        idx[rng.random((T, K)) < hole] = -1
        xs.append(rng.standard_normal((T, H)).astype(dtype))
        idxs.append(idx)
        ws.append((rng.random((T, K)) + 0.25).astype(np.float32))
    return xs, idxs, ws


# -- an independent implementation: every (rank, token, k) pair as flat arrays, vectorized -------------------

def pairs(idxs, L, Tmax):
    """Flat arrays over every valid (source s, token t, k): s, t, k, d (expert rank), l, j (slot column),
    first (the first k of its row with that expert)."""
    cols = {n: [] for n in ("s", "t", "k", "d", "l", "j", "first")}
    for s, idx in enumerate(idxs):
        T, K = idx.shape
        t, k = np.nonzero(idx >= 0)
        e = idx[t, k]
        earlier = np.array([np.any(idx[tt, :kk] == ee) for tt, kk, ee in zip(t, k, e)], bool)
        for n, v in (("s", np.full(t.size, s)), ("t", t), ("k", k), ("d", e // L), ("l", e % L),
                     ("j", s * Tmax + t), ("first", ~earlier)):
            cols[n].append(v)
    return {n: np.concatenate(v).astype(np.int64) if v else np.zeros(0, np.int64) for n, v in cols.items()}


def naive_dispatch(xs, idxs, ws, R, L, Tmax):
    p = pairs(idxs, L, Tmax)
    H, dt = xs[0].shape[1], xs[0].dtype
    recv = np.zeros((R, L, R * Tmax, H), dt)
    slot_k = np.full((R, L, R * Tmax), -1, np.int32)
    slot_w = np.zeros((R, L, R * Tmax), np.float32)
    f = p["first"].astype(bool)
    X = [np.asarray(x) for x in xs]
    for i in np.nonzero(f)[0]:
        recv[p["d"][i], p["l"][i], p["j"][i]] = X[p["s"][i]][p["t"][i]]
        slot_k[p["d"][i], p["l"][i], p["j"][i]] = p["k"][i]
    for i in range(p["s"].size):  # pairs come in (s, t, k) order: k ascending inside a token
        key = (p["d"][i], p["l"][i], p["j"][i])
        slot_w[key] = np.float32(slot_w[key] + ws[p["s"][i]][p["t"][i], p["k"][i]])
    counts = (slot_k >= 0).sum(axis=2).astype(np.int32)
    return recv, slot_k, slot_w, counts


def naive_combine(idxs, ws, Y, L, Tmax, weighted=True, unique=False):
    """Y [R, L, R*Tmax, H] (every rank's expert rows stacked) -> every rank's [T,H]."""
    outs = []
    for s, idx in enumerate(idxs):
        T, K = idx.shape
        acc = np.zeros((T, Y.shape[3]), np.float32)
        for k in range(K):
            e = idx[:, k]
            m = e >= 0
            if unique:
                m &= ~np.array([np.any(idx[t, :k] == idx[t, k]) for t in range(T)], bool).reshape(T)
            ee = np.where(m, e, 0)
            rows = Y[ee // L, ee % L, s * Tmax + np.arange(T)].astype(np.float32)
            term = ws[s][:, k:k + 1] * rows if weighted else rows
            acc = np.where(m[:, None], acc + term, acc).astype(np.float32)
        outs.append(acc.astype(Y.dtype))
    return outs


SHAPES = [
    (1, 3, 2, (5,), 5, 7),
    (1, 2, 3, (0,), 4, 3),
    (2, 3, 3, (5, 2), 5, 9),
    (2, 1, 4, (3, 0), 3, 5),       # E = 2 < K = 4: K is clamped to 2
    (4, 3, 4, (7, 0, 3, 7), 7, 11),
    (4, 2, 5, (1, 4, 4, 2), 4, 1),
]


def _K(R, L, K):
    return min(K, R * L)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("R,L,K,Ts,Tmax,H", SHAPES)
def test_reference_against_naive(rng, R, L, K, Ts, Tmax, H, dtype):
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    K = _K(R, L, K)
    xs, idxs, ws = make_case(rng, R, L, K, Ts, H, dt)
    res = ref.dispatch(xs, idxs, ws, R * L, Tmax)
    recv, slot_k, slot_w, counts = naive_dispatch(xs, idxs, ws, R, L, Tmax)
    for d in range(R):
        r_x, r_c, h = res[d]
        assert r_x.dtype == dt and r_x.shape == (L, R * Tmax, H)
        np.testing.assert_array_equal(r_x.view(np.uint8), recv[d].view(np.uint8))
        np.testing.assert_array_equal(h["slot_k"], slot_k[d])
        np.testing.assert_array_equal(h["slot_w"].view(np.uint32), slot_w[d].view(np.uint32))
        np.testing.assert_array_equal(r_c, counts[d])
        assert r_c.dtype == np.int32
    assert sum(int(c.sum()) for _, c, _ in res) == sum(
        len({int(e) for e in row if e >= 0}) for idx in idxs for row in idx)
    handles = [h for _, _, h in res]
    Y = rng.standard_normal((R, L, R * Tmax, H)).astype(dt)
    outs = ref.combine(handles, list(Y))
    for o, n in zip(outs, naive_combine(idxs, ws, Y, L, Tmax)):
        assert o.dtype == dt
        np.testing.assert_array_equal(o.view(np.uint8), n.view(np.uint8))
    G = rng.standard_normal((R, L, R * Tmax, H)).astype(dt)
    GW = rng.standard_normal((R, L, R * Tmax)).astype(np.float32)
    back = ref.dispatch_bwd(handles, list(G), list(GW))
    for s, ((gx, gw), n) in enumerate(zip(back, naive_combine(idxs, ws, G, L, Tmax, weighted=False, unique=True))):
        np.testing.assert_array_equal(gx.view(np.uint8), n.view(np.uint8))
        idx = idxs[s]
        ee = np.where(idx >= 0, idx, 0)
        want = np.where(idx >= 0, GW[ee // L, ee % L, s * Tmax + np.arange(idx.shape[0])[:, None]], 0)
        np.testing.assert_array_equal(gw, want.astype(np.float32))
    gouts = [rng.standard_normal((T, H)).astype(dt) for T in Ts]
    cb = ref.combine_bwd(handles, gouts, list(Y))
    for d, (gy, gw) in enumerate(cb):
        want = np.zeros((L, R * Tmax, H), dt)
        for l, j in zip(*np.nonzero(slot_k[d] >= 0)):
            s, t = divmod(int(j), Tmax)
            want[l, j] = (slot_w[d][l, j] * gouts[s][t].astype(np.float32)).astype(dt)
        np.testing.assert_array_equal(gy.view(np.uint8), want.view(np.uint8))
    for s, idx in enumerate(idxs):
        gw = cb[s][1]
        for t, k in zip(*np.nonzero(idx >= 0)):
            e = int(idx[t, k])
            want = float(np.dot(Y[e // L, e % L, s * Tmax + t].astype(np.float64), gouts[s][t].astype(np.float64)))
            assert gw[t, k] == pytest.approx(want, rel=1e-6, abs=1e-6)
        assert np.all(gw[idx < 0] == 0)


def naive_combine_partials(idxs, Y, slot_w, L, Tmax):
    """The rank-partial combine written over tokens at once: per owner s and rank d ascending, the partial of
    d's slots (each at its first k, k ascending; slot_w [R, L, R*Tmax] the expert ranks' slot weights) in
    fp32 from 0, rounded to Y's dtype, added in fp32 where the token has a slot on d; rounded once."""
    R, dt = Y.shape[0], Y.dtype
    outs = []
    for s, idx in enumerate(idxs):
        T, K = idx.shape
        tt = np.arange(T)
        acc = np.zeros((T, Y.shape[3]), np.float32)
        for d in range(R):
            z = np.zeros_like(acc)
            has = np.zeros(T, bool)
            for k in range(K):
                e = idx[:, k]
                first = ~np.array([np.any(idx[t, :k] == idx[t, k]) for t in range(T)], bool).reshape(T)
                m = (e >= 0) & (e // L == d) & first
                ee = np.where(m, e, 0)
                term = slot_w[d, ee % L, s * Tmax + tt][:, None] * Y[d, ee % L, s * Tmax + tt].astype(np.float32)
                z = np.where(m[:, None], z + term, z).astype(np.float32)
                has |= m
            acc = np.where(has[:, None], acc + z.astype(dt).astype(np.float32), acc).astype(np.float32)
        outs.append(acc.astype(dt))
    return outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("R,L,K,Ts,Tmax,H", SHAPES + [(4, 2, 8, (9, 3, 0, 9), 9, 13), (3, 4, 6, (8, 8, 5), 8, 6)])
def test_reference_combine_partials(rng, R, L, K, Ts, Tmax, H, dtype):
    """The rank-partial combine: bitwise the naive form of its arithmetic; close to a float64 sum of w * y over
    every k (duplicates included); close to the per-expert combine within the dtype's extra roundings (one per
    rank's partial)."""
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    K = _K(R, L, K)
    xs, idxs, ws = make_case(rng, R, L, K, Ts, H, dt)
    handles = [h for _, _, h in ref.dispatch(xs, idxs, ws, R * L, Tmax)]
    Y = rng.standard_normal((R, L, R * Tmax, H)).astype(dt)
    outs = ref.combine_partials(handles, list(Y))
    slot_w = np.stack([h["slot_w"] for h in handles])
    plain = ref.combine(handles, list(Y))
    eps = {"float32": 2.0**-23, "bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
    for s, (o, n, p) in enumerate(zip(outs, naive_combine_partials(idxs, Y, slot_w, L, Tmax), plain)):
        assert o.dtype == dt and o.shape == (Ts[s], H)
        np.testing.assert_array_equal(o.view(np.uint8), n.view(np.uint8))
        idx = idxs[s]
        want = np.zeros((Ts[s], H))
        mag = np.zeros((Ts[s], H))
        for t, k in zip(*np.nonzero(idx >= 0)):
            e = int(idx[t, k])
            term = float(ws[s][t, k]) * Y[e // L, e % L, s * Tmax + t].astype(np.float64)
            want[t] += term
            mag[t] += np.abs(term)
        # one rounding per rank's partial (at most R, each of |partial| <= mag) and the final one
        tol = (R + 2) * eps * mag + 1e-30
        assert np.all(np.abs(o.astype(np.float64) - want) <= tol)
        assert np.all(np.abs(o.astype(np.float64) - p.astype(np.float64)) <= 2 * tol)
        assert np.all(o[~np.any(idx >= 0, axis=1)].astype(np.float64) == 0)  # no expert: zero rows


@pytest.mark.parametrize("R,L,K,Ts,Tmax,H", SHAPES)
def test_reference_adjoint(rng, R, L, K, Ts, Tmax, H):
    """<dispatch(x), g> = <x, dispatch_bwd(g)> and <combine(y), g> = <y, combine_bwd(g)> (float64 sums)."""
    K = _K(R, L, K)
    xs, idxs, ws = make_case(rng, R, L, K, Ts, H)
    res = ref.dispatch(xs, idxs, ws, R * L, Tmax)
    handles = [h for _, _, h in res]
    G = rng.standard_normal((R, L, R * Tmax, H)).astype(np.float32)
    mask = np.stack([h["slot_k"] >= 0 for h in handles])[..., None]
    lhs = sum(float(np.sum(np.where(mask[d], res[d][0], 0).astype(np.float64) * G[d])) for d in range(R))
    back = ref.dispatch_bwd(handles, list(G))
    rhs = sum(float(np.sum(xs[s].astype(np.float64) * back[s][0])) for s in range(R))
    assert lhs == pytest.approx(rhs, rel=1e-5, abs=1e-4)
    Y = rng.standard_normal((R, L, R * Tmax, H)).astype(np.float32)
    gouts = [rng.standard_normal((T, H)).astype(np.float32) for T in Ts]
    outs = ref.combine(handles, list(Y))
    lhs = sum(float(np.sum(outs[s].astype(np.float64) * gouts[s])) for s in range(R))
    gy = ref.combine_bwd(handles, gouts)
    rhs = sum(float(np.sum(Y[d].astype(np.float64) * gy[d][0])) for d in range(R))
    assert lhs == pytest.approx(rhs, rel=1e-5, abs=1e-4)


def test_reference_weight_gradients_by_finite_difference(rng):
    R, L, K, Ts, Tmax, H = 2, 2, 3, (3, 2), 4, 5
    xs, idxs, ws = make_case(rng, R, L, K, Ts, H)
    res = ref.dispatch(xs, idxs, ws, R * L, Tmax)
    handles = [h for _, _, h in res]
    Y = rng.standard_normal((R, L, R * Tmax, H)).astype(np.float32)
    gouts = [rng.standard_normal((T, H)).astype(np.float32) for T in Ts]
    gw = [g for _, g in ref.combine_bwd(handles, gouts, list(Y))]
    # d/dw[t,k] of sum_t <combine(y)[t], g[t]> is <y[slot(t,k)], g[t]>: combine is linear in each w[t,k]
    for s in range(R):
        for t in range(Ts[s]):
            for k in range(K):
                e = int(idxs[s][t, k])
                want = 0.0 if e < 0 else float(np.dot(Y[e // L, e % L, s * Tmax + t].astype(np.float64), gouts[s][t]))
                assert gw[s][t, k] == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_reference_rejects():
    x = [np.zeros((3, 4), np.float32)]
    w = [np.ones((3, 2), np.float32)]
    with pytest.raises(ValueError, match="expert ids must be in"):
        ref.dispatch(x, [np.array([[0, 4]] * 3)], w, 4, 8)
    with pytest.raises(ValueError, match="exceeds max_tokens_per_rank"):
        ref.dispatch(x, [np.zeros((3, 2), np.int64)], w, 4, 2)
    with pytest.raises(ValueError, match="multiple"):
        ref.dispatch(x + x, [np.zeros((3, 2), np.int64)] * 2, w + w, 3, 8)


# -- LowLatencyGroup on CPU (one rank: the reference) ------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_group_cpu_matches_reference(rng, dtype):
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    L, K, T, Tmax, H = 5, 3, 6, 9, 7
    xs, idxs, ws = make_case(rng, 1, L, K, (T,), H, dt)
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt)
    recv, counts, h = g.dispatch(xs[0], idxs[0].astype(np.int32), ws[0])
    assert isinstance(h, LowLatencyHandle)
    rx, rc, rh = ref.dispatch(xs, idxs, ws, L, Tmax)[0]
    np.testing.assert_array_equal(recv.view(np.uint8), rx.view(np.uint8))
    np.testing.assert_array_equal(counts, rc)
    np.testing.assert_array_equal(h.slot_topk, rh["slot_k"])
    np.testing.assert_array_equal(h.slot_weights, rh["slot_w"])
    y = rng.standard_normal((L, Tmax, H)).astype(dt)
    np.testing.assert_array_equal(g.combine(h, y).view(np.uint8), ref.combine([rh], [y])[0].view(np.uint8))
    gr = rng.standard_normal((L, Tmax, H)).astype(dt)
    gwr = rng.standard_normal((L, Tmax)).astype(np.float32)
    gx, gw = g.dispatch_bwd(h, gr, gwr)
    wx, ww = ref.dispatch_bwd([rh], [gr], [gwr])[0]
    np.testing.assert_array_equal(gx.view(np.uint8), wx.view(np.uint8))
    np.testing.assert_array_equal(gw, ww)
    assert g.dispatch_bwd(h, gr)[1] is None
    go = rng.standard_normal((T, H)).astype(dt)
    gy, gw = g.combine_bwd(h, go, y)
    wy, ww = ref.combine_bwd([rh], [go], [y])[0]
    np.testing.assert_array_equal(gy.view(np.uint8), wy.view(np.uint8))
    np.testing.assert_array_equal(gw, ww)
    assert g.combine_bwd(h, go)[1] is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_group_cpu_combine_partials_matches_reference(rng, dtype):
    """A 1-rank group on CPU made with combine_partials=True: combine is the reference's rank-partial combine
    (bitwise); the backward passes are those of a group without it."""
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    L, K, T, Tmax, H = 5, 4, 7, 9, 11
    xs, idxs, ws = make_case(rng, 1, L, K, (T,), H, dt, dup=0.3)
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt, combine_partials=True)
    g0 = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt)
    assert g.combine_partials is True and g0.combine_partials is False
    assert "combine_partials=True" in repr(g) and "combine_partials" not in repr(g0)
    _, _, h = g.dispatch(xs[0], idxs[0], ws[0])
    _, _, h0 = g0.dispatch(xs[0], idxs[0], ws[0])
    rh = ref.dispatch(xs, idxs, ws, L, Tmax)[0][2]
    y = rng.standard_normal((L, Tmax, H)).astype(dt)
    out = g.combine(h, y)
    np.testing.assert_array_equal(out.view(np.uint8), ref.combine_partials([rh], [y])[0].view(np.uint8))
    go = rng.standard_normal((T, H)).astype(dt)
    for a, b in zip(g.combine_bwd(h, go, y), g0.combine_bwd(h0, go, y)):
        np.testing.assert_array_equal(a, b)
    gr = rng.standard_normal((L, Tmax, H)).astype(dt)
    np.testing.assert_array_equal(g.dispatch_bwd(h, gr)[0], g0.dispatch_bwd(h0, gr)[0])


def test_group_combine_partials_argument():
    """combine_partials: a bool (or NumPy bool; TypeError naming it otherwise), default False; the back buffer region holds
    Tmax*max(K, R) rows with it, Tmax*K without."""
    for bad in (1, 0, None, "yes", 1.0):
        with pytest.raises(TypeError, match="combine_partials: expected a bool"):
            LowLatencyGroup(None, 4, 6, 5, topk=2, combine_partials=bad)
    assert LowLatencyGroup(None, 4, 6, 5, topk=2, combine_partials=np.bool_(True)).combine_partials is True
    comm = type("Comm", (), {"rank": 0, "size": 4, "device": 0, "all_gather": None})()
    for K, partials, rows in ((2, False, 2), (2, True, 4), (6, True, 6), (6, False, 6)):
        g = LowLatencyGroup(comm, 8, 6, 5, topk=K, dtype=np.float32, combine_partials=partials)
        back = dict(g._regions())[("back", 0)]
        assert back == 5 * rows * 6 * 4, (K, partials)


def test_combine_partials_must_agree_on_every_rank():
    """The set-up's check of the all-gathered combine_partials settings (gathered with dedup's): equal ones
    pass, a mix is a ValueError naming combine_partials and the ranks on each side (the multi-GPU worker checks
    that the first op raises it on every rank)."""
    from moe_rt.ep_ll import check_combine_partials_agree

    for ok in ([1], [0], [1, 1, 1, 1], np.zeros(3, np.int64)):
        check_combine_partials_agree(ok)
    with pytest.raises(ValueError, match=r"combine_partials: the ranks disagree \(on at ranks \[1\], off at ranks "
                                         r"\[0, 2, 3\]\); pass the same LowLatencyGroup\(combine_partials=...\)"):
        check_combine_partials_agree(np.array([0, 1, 0, 0], np.int64))


def test_group_cpu_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    L, K, T, Tmax, H = 3, 2, 4, 4, 5
    xs, idxs, ws = make_case(rng, 1, L, K, (T,), H)
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=np.float32)
    recv, counts, h = g.dispatch(torch.from_numpy(xs[0]), torch.from_numpy(idxs[0]), torch.from_numpy(ws[0]))
    assert isinstance(recv, torch.Tensor) and isinstance(counts, torch.Tensor)
    out = g.combine(h, recv)
    rx, _, rh = ref.dispatch(xs, idxs, ws, L, Tmax)[0]
    np.testing.assert_array_equal(out.numpy(), ref.combine([rh], [rx])[0])


def test_group_validation(rng):
    L, K, T, Tmax, H = 4, 2, 3, 5, 6
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=np.float32)
    x = np.zeros((T, H), np.float32)
    idx = np.zeros((T, K), np.int32)
    w = np.ones((T, K), np.float32)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        LowLatencyGroup(None, L, H, 1025, topk=K)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        LowLatencyGroup(None, L, H, 0, topk=K)
    with pytest.raises(TypeError, match="max_tokens_per_rank"):
        LowLatencyGroup(None, L, H, 4.0, topk=K)
    with pytest.raises(ValueError, match="topk"):
        LowLatencyGroup(None, L, H, Tmax, topk=0)
    with pytest.raises(TypeError, match="dtype"):
        LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=np.int32)
    with pytest.raises(ValueError, match="hidden"):
        LowLatencyGroup(None, L, 0, Tmax, topk=K)
    with pytest.raises(ValueError, match="timeout"):
        LowLatencyGroup(None, L, H, Tmax, topk=K, timeout=0)
    with pytest.raises(TypeError, match="comm"):
        LowLatencyGroup(object(), L, H, Tmax, topk=K)
    # twice: the second round after good calls whose signatures the group remembers (the bad ones still raise)
    for _ in range(2):
        with pytest.raises(ValueError, match="exceeds max_tokens_per_rank=5"):
            g.dispatch(np.zeros((6, H), np.float32), np.zeros((6, K), np.int32), np.ones((6, K), np.float32))
        with pytest.raises(TypeError, match="x: dtype must be float32"):
            g.dispatch(x.astype(np.float16), idx, w)
        with pytest.raises(TypeError, match="topk_idx"):
            g.dispatch(x, idx.astype(np.float32), w)
        with pytest.raises(ValueError, match="K must be 2"):
            g.dispatch(x, np.zeros((T, 3), np.int32), np.ones((T, 3), np.float32))
        with pytest.raises(ValueError, match="x: expected shape"):
            g.dispatch(np.zeros((T, H + 1), np.float32), idx, w)
        with pytest.raises(ValueError, match="x: expected shape"):
            g.dispatch(np.zeros((T - 1, H), np.float32), idx, w)
        with pytest.raises(ValueError, match="topk_weights"):
            g.dispatch(x, idx, np.ones((T, K + 1), np.float32))
        with pytest.raises(TypeError, match="topk_weights"):
            g.dispatch(x, idx, np.ones((T, K), np.int32))
        with pytest.raises(TypeError, match="topk_weights"):
            g.dispatch(x, idx, None)
        with pytest.raises(ValueError, match=r"topk_idx: expert ids must be in \[-1, num_experts=4\), got 4"):
            g.dispatch(x, np.full((T, K), 4, np.int32), w)
        _, _, h = g.dispatch(x, idx, w)
        y = np.zeros((L, Tmax, H), np.float32)
        g.combine(h, y)
        with pytest.raises(TypeError, match="handle"):
            g.combine(object(), y)
        other = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=np.float32)
        with pytest.raises(ValueError, match="another group"):
            other.combine(h, y)
        with pytest.raises(ValueError, match="expert_out: expected shape"):
            g.combine(h, np.zeros((L, Tmax + 1, H), np.float32))
        with pytest.raises(TypeError, match="expert_out: dtype"):
            g.combine(h, y.astype(np.float16))
        with pytest.raises(ValueError, match="grad_recv_x: expected shape"):
            g.dispatch_bwd(h, np.zeros((L, Tmax, H + 1), np.float32))
        with pytest.raises(ValueError, match="grad_recv_weights"):
            g.dispatch_bwd(h, y, np.zeros((L, Tmax + 1), np.float32))
        with pytest.raises(ValueError, match="grad_out: expected shape"):
            g.combine_bwd(h, np.zeros((T + 1, H), np.float32))
        with pytest.raises(ValueError, match="expert_out: expected shape"):
            g.combine_bwd(h, x, np.zeros((L, Tmax, 1), np.float32))
    g.close()
    with pytest.raises(ValueError, match="closed"):
        g.dispatch(x, idx, w)


def test_group_dedup_argument_and_env(monkeypatch):
    """dedup=None takes MOE_RT_LL_DEDUP (unset or empty: on; 0: off; 1: on; anything else a ValueError naming
    it); an explicit bool wins over the variable; a non-bool is a TypeError."""
    args = (None, 4, 6, 5)
    for v, want in (("", True), ("1", True), ("0", False)):
        monkeypatch.setenv("MOE_RT_LL_DEDUP", v)
        assert LowLatencyGroup(*args, topk=2).dedup is want
        assert LowLatencyGroup(*args, topk=2, dedup=not want).dedup is (not want)
    assert "dedup=False" in repr(LowLatencyGroup(*args, topk=2, dedup=False))
    monkeypatch.delenv("MOE_RT_LL_DEDUP")
    assert LowLatencyGroup(*args, topk=2).dedup is True
    for bad in ("2", "yes", "true", " 1"):
        monkeypatch.setenv("MOE_RT_LL_DEDUP", bad)
        with pytest.raises(ValueError, match="MOE_RT_LL_DEDUP"):
            LowLatencyGroup(*args, topk=2)
    monkeypatch.setenv("MOE_RT_LL_DEDUP", "1")
    with pytest.raises(TypeError, match="dedup"):
        LowLatencyGroup(*args, topk=2, dedup=1)


def test_dedup_must_agree_on_every_rank():
    """The set-up's check of the all-gathered dedup settings: equal ones pass, a mix is a ValueError naming
    dedup and the ranks on each side (the multi-GPU worker checks that the first op raises it on every rank)."""
    from moe_rt.ep_ll import check_dedup_agrees

    for ok in ([1], [0], [1, 1, 1, 1], np.zeros(3, np.int64)):
        check_dedup_agrees(ok)
    with pytest.raises(ValueError, match=r"dedup: the ranks disagree \(on at ranks \[0, 2\], off at ranks \[1\]\)"):
        check_dedup_agrees(np.array([1, 0, 1], np.int64))
    with pytest.raises(ValueError, match="MOE_RT_LL_DEDUP"):
        check_dedup_agrees([0, 1])


def test_group_transport_argument_and_env(monkeypatch):
    """transport: 'auto' (default, or MOE_RT_LL_TRANSPORT), 'direct' or 'nccl'; other values and types refused
    before any collective; the choice is made at the first CUDA op (group.transport None until then, and on the
    CPU path, whose reference needs no transport); repr names a transport asked for."""
    monkeypatch.delenv("MOE_RT_LL_TRANSPORT", raising=False)
    g = LowLatencyGroup(None, 4, 8, 4, topk=2, dtype=np.float32)
    assert g._want == "auto" and g.transport is None and "transport" not in repr(g)
    g = LowLatencyGroup(None, 4, 8, 4, topk=2, dtype=np.float32, transport="nccl")
    assert g._want == "nccl" and "transport='nccl'" in repr(g)
    monkeypatch.setenv("MOE_RT_LL_TRANSPORT", "nccl")
    assert LowLatencyGroup(None, 4, 8, 4, topk=2, dtype=np.float32)._want == "nccl"
    assert LowLatencyGroup(None, 4, 8, 4, topk=2, dtype=np.float32, transport="direct")._want == "direct"
    monkeypatch.setenv("MOE_RT_LL_TRANSPORT", "ib")
    with pytest.raises(ValueError, match="MOE_RT_LL_TRANSPORT: expected auto, direct or nccl, got 'ib'"):
        LowLatencyGroup(None, 4, 8, 4, topk=2, dtype=np.float32)
    monkeypatch.delenv("MOE_RT_LL_TRANSPORT")
    with pytest.raises(ValueError, match="transport: expected 'auto', 'direct' or 'nccl', got 'NCCL'"):
        LowLatencyGroup(None, 4, 8, 4, topk=2, dtype=np.float32, transport="NCCL")
    with pytest.raises(TypeError, match="transport: expected a str"):
        LowLatencyGroup(None, 4, 8, 4, topk=2, dtype=np.float32, transport=1)


def test_group_cpu_nccl_transport_runs_the_reference(rng):
    """A 1-rank group asked for the NCCL transport on CPU arrays runs the same reference (the transport only
    moves rows between GPUs)."""
    L, K, T, Tmax, H = 4, 2, 3, 5, 8
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx = np.array([[0, 3], [1, -1], [2, 2]], np.int32)
    w = rng.random((T, K)).astype(np.float32)
    outs = []
    for transport in ("auto", "nccl"):
        g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=np.float32, transport=transport)
        recv, counts, h = g.dispatch(x, idx, w)
        outs.append((recv, counts, g.combine(h, recv)))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_transport_must_agree_on_every_rank():
    """The set-up's check of the all-gathered transport choices: equal ones pass, a mix is a ValueError naming
    each rank's (the multi-GPU worker checks that the first op raises it on every rank)."""
    from moe_rt.ep_ll import check_transport_agrees

    check_transport_agrees([1, 1])
    check_transport_agrees([2, 2, 2])
    with pytest.raises(ValueError, match=r"transport: the ranks disagree \(rank 0: nccl, rank 1: direct\)"):
        check_transport_agrees(np.array([2, 1], np.int64))


def test_group_sync_env(monkeypatch):
    """MOE_RT_LL_SYNC, read when the group is made: unset or empty: pairwise; exactly barrier or pairwise;
    anything else a ValueError naming the variable. A group keeps the mode it was made with."""
    args = (None, 4, 6, 5)
    monkeypatch.delenv("MOE_RT_LL_SYNC", raising=False)
    assert LowLatencyGroup(*args, topk=2).sync == "pairwise"
    for v, want in (("", "pairwise"), ("pairwise", "pairwise"), ("barrier", "barrier")):
        monkeypatch.setenv("MOE_RT_LL_SYNC", v)
        g = LowLatencyGroup(*args, topk=2)
        assert g.sync == want
        assert ("sync=barrier" in repr(g)) is (want == "barrier")
    monkeypatch.setenv("MOE_RT_LL_SYNC", "pairwise")
    assert g.sync == "barrier"  # read once, when the group was made
    for bad in ("Pairwise", "pair", " barrier", "barrier ", "1", "0", "none"):
        monkeypatch.setenv("MOE_RT_LL_SYNC", bad)
        with pytest.raises(ValueError, match="MOE_RT_LL_SYNC"):
            LowLatencyGroup(*args, topk=2)


def test_sync_must_agree_on_every_rank():
    """The set-up's check of the all-gathered MOE_RT_LL_SYNC codes (0 barrier, 1 pairwise): equal ones pass, a
    mix is a ValueError naming the variable and each rank's mode."""
    from moe_rt.ep_ll import SYNC_MODES, check_sync_agrees

    assert SYNC_MODES == ("barrier", "pairwise")
    for ok in ([1], [0], [1, 1, 1, 1], np.zeros(3, np.int64)):
        check_sync_agrees(ok)
    with pytest.raises(ValueError, match=r"MOE_RT_LL_SYNC: the ranks disagree \(rank 0: barrier, rank 1: pairwise"):
        check_sync_agrees(np.array([0, 1, 0], np.int64))


@pytest.mark.parametrize("R,L,K,Ts,Tmax", [(2, 128, 8, (128, 128), 128), (4, 64, 8, (128, 100, 0, 128), 128),
                                           (3, 2, 4, (9, 5, 7), 9), (4, 3, 6, (6, 6, 1, 4), 6)])
def test_wire_rows_are_the_references_distinct_token_rank_pairs(rng, R, L, K, Ts, Tmax):
    """ep_ll.wire_rows (the rows bench_ep's LL wire_MB counts) is, per source rank, the number of distinct
    (token, other destination rank) pairs with dedup and of distinct (token, expert on another rank) pairs
    without, both read off the reference's slot tables of every destination (a token of source s reaches
    rank d when any local expert's slot (l, s*Tmax + t) of d is valid); duplicates and -1 ids included."""
    from moe_rt.ep_ll import wire_rows

    xs, idxs, ws = make_case(rng, R, L, K, Ts, 1)
    res = ref.dispatch(xs, idxs, ws, R * L, Tmax)
    for s in range(R):
        cols = slice(s * Tmax, (s + 1) * Tmax)
        valid = [res[d][2]["slot_k"][:, cols] >= 0 for d in range(R) if d != s]  # [L, Tmax] per other rank
        per_rank = sum(int(v.any(axis=0).sum()) for v in valid)
        per_expert = sum(int(v.sum()) for v in valid)
        assert wire_rows(idxs[s], R * L, R, s) == per_rank
        assert wire_rows(idxs[s], R * L, R, s, dedup=False) == per_expert
        assert per_rank <= per_expert


def test_group_cpu_split_dispatch(rng):
    L, K, T, Tmax, H = 4, 3, 5, 6, 7
    xs, idxs, ws = make_case(rng, 1, L, K, (T,), H)
    for nb in (1, 2):
        g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=np.float32, num_buffers=nb)
        assert g.num_buffers == nb
        recv, counts, h, hook = g.dispatch(xs[0], idxs[0], ws[0], return_recv_hook=True)
        with pytest.raises(ValueError, match="receive hook has not run"):
            g.combine(h, recv)
        with pytest.raises(ValueError, match="receive hook has not run"):
            g.dispatch_bwd(h, recv)
        hook()
        with pytest.raises(ValueError, match="already called"):
            hook()
        rx, rc, rh = ref.dispatch(xs, idxs, ws, L, Tmax)[0]
        np.testing.assert_array_equal(recv, rx)
        np.testing.assert_array_equal(counts, rc)
        np.testing.assert_array_equal(g.combine(h, recv), ref.combine([rh], [rx])[0])
        assert len(g.dispatch(xs[0], idxs[0], ws[0])) == 3
    with pytest.raises(TypeError, match="return_recv_hook"):
        g.dispatch(xs[0], idxs[0], ws[0], return_recv_hook=1)
    for bad in (0, 3):
        with pytest.raises(ValueError, match="num_buffers"):
            LowLatencyGroup(None, L, H, Tmax, topk=K, num_buffers=bad)
    with pytest.raises(TypeError, match="num_buffers"):
        LowLatencyGroup(None, L, H, Tmax, topk=K, num_buffers=1.0)


# -- FP8 dispatch (dispatch(..., fp8=True)) ----------------------------------------------------------------

def fp8_case(rng, R, L, K, Ts, H, dtype):
    """make_case with the rows replaced by FP8's hard cases (tests/test_fp8.py edge_inputs: zero blocks,
    subnormals, values past 448, exact e4m3 ties)."""
    from test_fp8 import edge_inputs

    xs, idxs, ws = make_case(rng, R, L, K, Ts, H, dtype)
    return [edge_inputs(rng, T, H, dtype, 128) for T in Ts], idxs, ws


def fp8_valid_rows(arr, slot_k):
    """The rows of valid slots as bytes (the others are unspecified on the GPU)."""
    return np.ascontiguousarray(np.asarray(arr)[slot_k >= 0]).view(np.uint8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("R,L,K,Ts,Tmax,H", SHAPES + [(2, 2, 3, (4, 3), 4, 200), (1, 3, 2, (6,), 6, 256)])
def test_reference_fp8_is_quantize_then_dispatch(rng, R, L, K, Ts, Tmax, H, dtype):
    """dispatch_fp8 of float rows = the independent slots (naive_dispatch) of quantize_fp8's codes and of its
    scales (each checked against tests/test_fp8.py's independent quantization), with dispatch's handle."""
    from test_fp8 import independent_quantize

    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    K = _K(R, L, K)
    xs, idxs, ws = fp8_case(rng, R, L, K, Ts, H, dt)
    res = ref.dispatch_fp8(xs, idxs, ws, R * L, Tmax)
    pairs = [moe_rt.quantize_fp8(x) for x in xs]
    for x, (q, sc) in zip(xs, pairs):
        iq, isc = independent_quantize(x, 128)
        np.testing.assert_array_equal(sc.view(np.uint32), isc.view(np.uint32))
        np.testing.assert_array_equal(q.view(np.uint8), iq.view(np.uint8))
    S = -(-H // 128)
    codes, _, _, _ = naive_dispatch([q.view(np.uint8) for q, _ in pairs], idxs, ws, R, L, Tmax)
    scales, slot_k, slot_w, counts = naive_dispatch([sc for _, sc in pairs], idxs, ws, R, L, Tmax)
    plain = ref.dispatch(xs, idxs, ws, R * L, Tmax)
    for d in range(R):
        rq, rs, rc, h = res[d]
        assert rq.dtype == np.dtype(ml_dtypes().float8_e4m3fn) and rq.shape == (L, R * Tmax, H)
        assert rs.dtype == np.float32 and rs.shape == (L, R * Tmax, S)
        np.testing.assert_array_equal(rq.view(np.uint8), codes[d])
        np.testing.assert_array_equal(rs.view(np.uint32), scales[d].view(np.uint32))
        np.testing.assert_array_equal(rc, counts[d])
        np.testing.assert_array_equal(h["slot_k"], slot_k[d])
        np.testing.assert_array_equal(h["slot_w"].view(np.uint32), slot_w[d].view(np.uint32))
        for key in ("idx", "w", "route", "slot_k", "slot_w", "counts"):
            np.testing.assert_array_equal(h[key], plain[d][2][key])
    # a pre-quantized pair (uint8 codes) goes through as is, in its own dtype
    again = ref.dispatch_fp8([q.view(np.uint8) for q, _ in pairs], idxs, ws, R * L, Tmax,
                             scales=[sc for _, sc in pairs])
    for (rq, rs, _, _), (q2, s2, _, _) in zip(res, again):
        assert q2.dtype == np.uint8
        np.testing.assert_array_equal(q2, rq.view(np.uint8))
        np.testing.assert_array_equal(s2.view(np.uint32), rs.view(np.uint32))


def ml_dtypes():
    import ml_dtypes as m

    return m


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("H", [7, 200, 256])
def test_group_cpu_fp8_matches_reference(rng, dtype, H):
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    L, K, T, Tmax = 5, 3, 6, 9
    xs, idxs, ws = fp8_case(rng, 1, L, K, (T,), H, dt)
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt, fp8=True)
    assert g.fp8 and "fp8=True" in repr(g)
    rq, rs, rc, rh = ref.dispatch_fp8(xs, idxs, ws, L, Tmax)[0]
    q, s, counts, h = g.dispatch(xs[0], idxs[0].astype(np.int32), ws[0], fp8=True)
    assert q.dtype == rq.dtype and s.dtype == np.float32
    np.testing.assert_array_equal(q.view(np.uint8), rq.view(np.uint8))
    np.testing.assert_array_equal(s.view(np.uint32), rs.view(np.uint32))
    np.testing.assert_array_equal(counts, rc)
    np.testing.assert_array_equal(h.slot_topk, rh["slot_k"])
    np.testing.assert_array_equal(h.slot_weights, rh["slot_w"])
    # dequantize=True: the valid rows are dequantize_fp8 of the received pair, in the group's dtype
    y, counts2, h2 = g.dispatch(xs[0], idxs[0], ws[0], fp8=True, dequantize=True)
    assert y.dtype == dt and y.shape == (L, Tmax, H)
    want = moe_rt.dequantize_fp8(rq.reshape(-1, H), rs.reshape(-1, s.shape[2]), dt).reshape(y.shape)
    np.testing.assert_array_equal(fp8_valid_rows(y, rh["slot_k"]), fp8_valid_rows(want, rh["slot_k"]))
    np.testing.assert_array_equal(counts2, rc)
    # pre-quantized pairs: float8_e4m3fn and uint8 codes come back in their own dtype
    xq, xsc = moe_rt.quantize_fp8(xs[0])
    for codes in (xq, xq.view(np.uint8)):
        q3, s3, _, _ = g.dispatch((codes, xsc), idxs[0], ws[0], fp8=True)
        assert q3.dtype == codes.dtype
        np.testing.assert_array_equal(q3.view(np.uint8), rq.view(np.uint8))
        np.testing.assert_array_equal(s3.view(np.uint32), rs.view(np.uint32))
    y3, _, _ = g.dispatch((xq.view(np.uint8), xsc), idxs[0], ws[0], fp8=True, dequantize=True)
    np.testing.assert_array_equal(y3.view(np.uint8), y.view(np.uint8))
    # combine and both backwards after an FP8 dispatch: the float ones (the handle is dispatch's)
    yo = rng.standard_normal((L, Tmax, H)).astype(dt)
    np.testing.assert_array_equal(g.combine(h, yo).view(np.uint8), ref.combine([rh], [yo])[0].view(np.uint8))
    gx, _ = g.dispatch_bwd(h2, yo)
    np.testing.assert_array_equal(gx.view(np.uint8), ref.dispatch_bwd([rh], [yo])[0][0].view(np.uint8))
    go = rng.standard_normal((T, H)).astype(dt)
    gy, gw = g.combine_bwd(h, go, yo)
    wy, ww = ref.combine_bwd([rh], [go], [yo])[0]
    np.testing.assert_array_equal(gy.view(np.uint8), wy.view(np.uint8))
    np.testing.assert_array_equal(gw, ww)
    # a bf16 dispatch on the same group still works
    recv, _, _ = g.dispatch(xs[0], idxs[0], ws[0])
    np.testing.assert_array_equal(recv.view(np.uint8), ref.dispatch(xs, idxs, ws, L, Tmax)[0][0].view(np.uint8))


def test_group_cpu_fp8_split_and_torch(rng):
    torch = pytest.importorskip("torch")
    L, K, T, Tmax, H = 4, 3, 5, 6, 130
    xs, idxs, ws = fp8_case(rng, 1, L, K, (T,), H, bf16())
    rq, rs, rc, rh = ref.dispatch_fp8(xs, idxs, ws, L, Tmax)[0]
    for nb in (1, 2):
        g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=bf16(), num_buffers=nb, fp8=True)
        q, s, counts, h, hook = g.dispatch(xs[0], idxs[0], ws[0], fp8=True, return_recv_hook=True)
        with pytest.raises(ValueError, match="receive hook has not run"):
            g.combine(h, np.zeros((L, Tmax, H), bf16()))
        hook()
        with pytest.raises(ValueError, match="already called"):
            hook()
        np.testing.assert_array_equal(q.view(np.uint8), rq.view(np.uint8))
        np.testing.assert_array_equal(s, rs)
        assert len(g.dispatch(xs[0], idxs[0], ws[0], fp8=True, dequantize=True, return_recv_hook=True)) == 4
    xt = torch.from_numpy(xs[0].view(np.uint16)).view(torch.bfloat16)
    q, s, counts, h = g.dispatch(xt, torch.from_numpy(idxs[0]), torch.from_numpy(ws[0]), fp8=True)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), rq.view(np.uint8))
    y, _, _ = g.dispatch(xt, torch.from_numpy(idxs[0]), torch.from_numpy(ws[0]), fp8=True, dequantize=True)
    assert y.dtype == torch.bfloat16
    qt, st = moe_rt.quantize_fp8(xt)
    q2, s2, _, _ = g.dispatch((qt, st), torch.from_numpy(idxs[0]), torch.from_numpy(ws[0]), fp8=True)
    assert q2.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(q2.view(torch.uint8).numpy(), rq.view(np.uint8))


def test_group_fp8_validation(rng):
    L, K, T, Tmax, H = 4, 2, 3, 5, 200
    S = 2
    x = np.zeros((T, H), np.float32)
    idx = np.zeros((T, K), np.int32)
    w = np.ones((T, K), np.float32)
    q = np.zeros((T, H), np.uint8)
    sc = np.ones((T, S), np.float32)
    plain = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=np.float32)
    assert not plain.fp8
    with pytest.raises(ValueError, match=r"fp8: this group has no FP8 receive buffers.*fp8=True"):
        plain.dispatch(x, idx, w, fp8=True)
    with pytest.raises(ValueError, match="fp8: this group has no FP8"):
        plain.dispatch((q, sc), idx, w, fp8=True, dequantize=True)
    with pytest.raises(TypeError, match="fp8"):
        LowLatencyGroup(None, L, H, Tmax, topk=K, fp8=1)
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=np.float32, fp8=True)
    g.dispatch((q, sc), idx, w, fp8=True)  # good calls first: their signatures remembered, the bad ones below
    g.dispatch(x, idx, w, fp8=True)  # still raise
    for grp in (plain, g):
        with pytest.raises(ValueError, match="dequantize: only meaningful with fp8=True"):
            grp.dispatch(x, idx, w, dequantize=True)
        with pytest.raises(TypeError, match="pair is FP8 input: pass fp8=True"):
            grp.dispatch((q, sc), idx, w)
    with pytest.raises(TypeError, match="fp8: expected a bool"):
        g.dispatch(x, idx, w, fp8=1)
    with pytest.raises(TypeError, match="dequantize: expected a bool"):
        g.dispatch(x, idx, w, fp8=True, dequantize="yes")
    with pytest.raises(TypeError, match="x: expected an array"):
        g.dispatch((q, sc, sc), idx, w, fp8=True)
    with pytest.raises(TypeError, match="x: dtype must be float32"):
        g.dispatch(x.astype(np.float16), idx, w, fp8=True)
    for bad in (x, q.view(ml_dtypes().float8_e5m2), q.astype(np.int8)):
        with pytest.raises(TypeError, match="x_fp8: expected float8_e4m3fn values or their uint8 codes"):
            g.dispatch((bad, sc), idx, w, fp8=True)
    with pytest.raises(ValueError, match="x_fp8: expected shape"):
        g.dispatch((np.zeros((T, H + 1), np.uint8), sc), idx, w, fp8=True)
    with pytest.raises(ValueError, match="x_fp8: expected shape"):
        g.dispatch((np.zeros((T + 1, H), np.uint8), sc), idx, w, fp8=True)
    with pytest.raises(ValueError, match="x_fp8: expected a 2-D array"):
        g.dispatch((q.reshape(-1), sc), idx, w, fp8=True)
    for bad in (sc.astype(np.float16), sc.astype(np.float64), sc.view(np.uint32)):
        with pytest.raises(TypeError, match="scales"):
            g.dispatch((q, bad), idx, w, fp8=True)
    for bad in (np.ones((T, S + 1), np.float32), np.ones((T - 1, S), np.float32), np.ones((T, 1), np.float32)):
        with pytest.raises(ValueError, match=r"scales: expected shape \[T, ceil\(H/128\)\] = \(3, 2\)"):
            g.dispatch((q, bad), idx, w, fp8=True)
    with pytest.raises(ValueError, match="scales: expected a 2-D array"):
        g.dispatch((q, sc.reshape(-1)), idx, w, fp8=True)
    with pytest.raises(ValueError, match="exceeds max_tokens_per_rank"):
        g.dispatch((np.zeros((6, H), np.uint8), np.ones((6, S), np.float32)), np.zeros((6, K), np.int32),
                   np.ones((6, K), np.float32), fp8=True)
    with pytest.raises(ValueError, match="expert ids must be in"):
        g.dispatch((q, sc), np.full((T, K), 9, np.int32), w, fp8=True)
    with pytest.raises(TypeError, match="topk_weights"):
        g.dispatch((q, sc), idx, None, fp8=True)


def test_epgroup_names_the_low_latency_class():
    with pytest.raises(ValueError, match="LowLatencyGroup"):
        moe_rt.EpGroup(None, 4, 8, 4, mode="low_latency")


def test_chunk_tokens():
    from moe_rt.ep_ll import chunk_tokens

    assert [chunk_tokens(n) for n in (1, 128, 129, 1024)] == [1, 1, 2, 8]
    assert all(-(-n // chunk_tokens(n)) <= 128 for n in range(1, 1025))


# -- the kernels compile (NVRTC, no GPU) -----------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_low_latency_kernels_compile(arch):
    from moe_rt import _jit, ep_ll

    names = [n for f, n in _jit.registered() if f == ep_ll._FILE and n in ep_ll._names]
    assert len(names) == len(ep_ll._names) == 156  # 42 default builds, 36 pairwise, 78 of the NCCL transport
    image, lowered = _jit.compile_offline("ep.cu", arch, names)
    assert set(lowered) == set(names) and image


# -- the CUDA path's host side, the device stood in for (CPU) --------------------------------------------

def _kernel_params(name):
    """``[(C type, name)]`` of kernel ``name``'s parameters in kernels/ep.cu."""
    import re

    text = (ROOT / "kernels" / "ep.cu").read_text()
    m = re.search(rf"\b{name}\(([^)]*)\)\s*\{{", text)
    assert m, name
    out = []
    for p in m.group(1).split(","):
        words = p.replace("*", " * ").split()
        out.append(("ptr" if "*" in words else words[-2], words[-1]))
    return out


def _stand_ins():
    """tools/profile_ll_host.py's StandIns (the device stood in for)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_ll_host", ROOT / "tools" / "profile_ll_host.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.StandIns


class _LLTrace:
    """The device stood in for (tools/profile_ll_host.py, undone after the test: the core plans in a planning
    context and records its launches), each launch recorded with its arguments by parameter name after
    checking their count and ranges; ``take()``: the launches and allocations since the last take."""

    def __init__(self, monkeypatch):
        pytest.importorskip("cupy")
        self.st = _stand_ins()(monkeypatch.setattr, resident=8, sm_count=4)
        self.st.on_launch = self._launch
        self.events, self.kernels = [], []
        self.array, self.dev, self.group = self.st.array, self.st.dev, self.st.group

    def _launch(self, fn, grid, block, args):
        self.kernels.append(fn.name)
        name = fn.name.split("<")[0]
        params = _kernel_params(name)
        assert len(args) == len(params), name
        for (ctype, pname), a in zip(params, args):  # int parameters get 32-bit values, pointers addresses
            assert (-2**31 <= a < 2**31) if ctype == "int" else a >= 0, (name, pname, a)
        self.events.append((name, grid, block, {pname: a for (_, pname), a in zip(params, args)}))

    def take(self):
        ev, self.events, self.kernels = self.events, [], []
        allocs, self.st.allocs = self.st.allocs, 0
        return ev, allocs


@pytest.mark.parametrize("T", [11, 0])
@pytest.mark.parametrize("R,K", [(2, 3), (4, 2)])
@pytest.mark.parametrize("sync", ["barrier", ""])  # MOE_RT_LL_SYNC: barrier or unset (pairwise)
def test_cuda_host_path_combine_partials_launches(monkeypatch, T, R, K, sync):
    """A group made with combine_partials=True (device stood in for): combine is the same launch (grid,
    block; after the barrier launch with MOE_RT_LL_SYNC=barrier) of the PARTIALS build with the handle's slot_w
    instead of w; dispatch_bwd and combine_bwd's weight gather launch as without it (the plain build); the
    back region spans Tmax*max(K, R) rows."""
    import ml_dtypes

    tr = _LLTrace(monkeypatch)
    monkeypatch.setenv("MOE_RT_LL_SYNC", sync)
    kern = "ep_ll_combine" + ("" if sync == "barrier" else "_pairwise")
    lead = ["ep_direct_barrier"] if sync == "barrier" else []
    me, H, Tmax, bf = R - 1, 40, 13, np.dtype(ml_dtypes.bfloat16)
    E = 3 * R
    L = E // R
    g = tr.group(R, me, E, H, Tmax, K, bf, 1, False, combine_partials=True)
    assert g.combine_partials
    assert g._offs[("back", 0)][1] == Tmax * max(K, R) * H * 2
    OP = _ep_direct.OP_CODES
    x, idx, w = tr.dev((T, H), bf), tr.dev((T, K), np.int64), tr.dev((T, K), np.float32)
    y, gout = tr.dev((L, R * Tmax, H), bf), tr.dev((T, H), bf)
    _, _, h = g.dispatch(x, idx, w)
    tr.take()
    t = {k: h._a[k].data.ptr if h._a[k].size else 0 for k in ("idx", "w", "route", "slot_k", "slot_w", "counts")}
    res = g.combine(h, y)
    name = tr.kernels[-1]
    ev, allocs = tr.take()
    assert allocs == 1 and res.shape == (T, H)
    assert [e[0] for e in ev] == lead + [kern] and ev[-1][1:3] == (8, 512)
    a = ev[-1][3]
    assert name == f"{kern}<__nv_bfloat16, true, true>"  # the PARTIALS build
    assert (a["w"], a["slot_w"], a["gws"], a["op"]) == (0, t["slot_w"], 0, OP["combine"])
    assert (a["y"], a["route"], a["idx"], a["out"], a["Tn"]) == (y.ptr, t["route"], t["idx"],
                                                                  res.data.ptr if T else 0, T)
    assert a["peer_back"] == g._tables[("back", 0)] and (a["R"], a["me"], a["K"]) == (R, me, K)
    g.dispatch_bwd(h, y)
    name = tr.kernels[-1]
    ev, _ = tr.take()
    assert (ev[-1][3]["w"], ev[-1][3]["slot_w"]) == (0, 0) and name == f"{kern}<__nv_bfloat16, true, false>"
    g.combine_bwd(h, gout, tr.dev((L, R * Tmax, H), bf))
    name = tr.kernels[-1]
    ev, _ = tr.take()
    assert ev[-1][0] == kern and ev[-1][3]["slot_w"] == 0
    assert name == f"{kern}<__nv_bfloat16, true, false>"


@pytest.mark.parametrize("T", [11, 0])
@pytest.mark.parametrize("partials", [False, True])
def test_cuda_host_path_nccl_transport(monkeypatch, T, partials):
    """LowLatencyGroup(transport="nccl") on CUDA (device stood in for): each op's launches (the NCCL
    transport's kernels, each given as many arguments as it takes, in range), the buffer set's own regions and
    the handle's tables as arguments, and the first call of each op signature waiting for its stream before the
    core loads its kernels (later calls wait for nothing). The exchanges themselves are not recorded."""
    import ml_dtypes

    tr = _LLTrace(monkeypatch)
    R, me, E, H, Tmax, K = 2, 1, 6, 40, 13, 3
    L, bf = E // R, np.dtype(ml_dtypes.bfloat16)
    g = tr.group(R, me, E, H, Tmax, K, bf, 2, True, partials, transport="nccl")
    waits = []
    monkeypatch.setattr(g, "_wait", lambda stream, op, timeout=None: waits.append(op))
    x, idx, w = tr.dev((T, H), bf), tr.dev((T, K), np.int64), tr.dev((T, K), np.float32)
    y, gout, gsw = tr.dev((L, R * Tmax, H), bf), tr.dev((T, H), bf), tr.dev((L, R * Tmax), np.float32)
    base = 1 << 56

    def region(name, b):
        return base + g._offs[(name, b)][0]

    def names(ev):
        return [(n, a) for n, _, _, a in ev]

    tr.take()
    _, _, h0 = g.dispatch(x, idx, w)
    (pack, pa), (expand, ea) = names(tr.take()[0])
    assert (pack, expand) == ("ep_ll_nccl_pack", "ep_ll_nccl_expand") and waits == ["dispatch"]
    t = h0._a
    assert pa["gather"] == region("gather", 0) and pa["gather_meta"] == region("gather_meta", 0)
    assert pa["counts"] == t["counts"].data.ptr and pa["meta"] == 1 and pa["Tn"] == T and pa["me"] == me
    assert ea["recv"] == region("recv", 0) and ea["slot_k"] == t["slot_k"].data.ptr
    assert ea["route_out"] == t["route"].data.ptr and ea["scaled"] == 0
    _, _, h1 = g.dispatch(x, idx, w)  # the second buffer set; the same signature: no wait
    (_, pa), (_, ea) = names(tr.take()[0])
    assert pa["gather"] == region("gather", 1) and ea["recv"] == region("recv", 1) and waits == ["dispatch"]
    out = g.combine(h0, y)
    (red, ra), (own, oa) = names(tr.take()[0])
    assert (red, own) == ("ep_ll_nccl_reduce", "ep_ll_nccl_owner") and waits == ["dispatch", "combine"]
    assert ra["back_send"] == region("back_send", 0) and ra["back"] == region("back", 0) and ra["rows"] == 1
    assert ra["slot_w"] == (t["slot_w"].data.ptr if partials else 0) and ra["route"] == t["route"].data.ptr
    assert oa["out"] == (out.data.ptr if T else 0) and oa["back"] == region("back", 0) and oa["Tn"] == T
    assert oa["w"] == (0 if partials or not T else t["w"].data.ptr)
    g.dispatch_bwd(h1, y, gsw)
    (_, ra), (_, oa) = names(tr.take()[0])
    assert ra["slot_grads"] == gsw.data.ptr and ra["back"] == region("back", 1) and oa["w"] == 0
    g.combine_bwd(h0, gout, y)
    got = [n for n, _ in names(tr.take()[0])]
    assert got == ["ep_ll_nccl_pack", "ep_ll_nccl_expand", "ep_ll_slot_dot", "ep_ll_nccl_reduce", "ep_ll_nccl_owner"]
    g.combine_bwd(h0, gout)
    assert [n for n, _ in names(tr.take()[0])] == ["ep_ll_nccl_pack", "ep_ll_nccl_expand"]
    *_, hook = g.dispatch(x, idx, w, return_recv_hook=True)  # the push: the pack (and the exchange)
    assert [n for n, _ in names(tr.take()[0])] == ["ep_ll_nccl_pack"]
    hook()
    (n, ea), = names(tr.take()[0])
    assert n == "ep_ll_nccl_expand" and ea["recv"] == region("recv", 0)
    g.dispatch(x, idx, w, fp8=True, dequantize=True)
    full = list(tr.kernels)  # the kernels' full names (template arguments)
    (_, pa), (_, ea) = names(tr.take()[0])
    assert full[0].startswith("ep_ll_nccl_pack<") and full[0].endswith(", true>")  # quantized in the pack
    assert full[1].startswith("ep_ll_nccl_expand<") and full[1].endswith(", 2>")  # dequantized on arrival
    assert ea["recv"] == region("recv", 1) and pa["gather_q"] == region("gather_q", 1)
    assert waits == ["dispatch", "combine", "dispatch_bwd", "combine_bwd", "combine_bwd", "combine_bwd", "dispatch",
                     "dispatch", "dispatch"]


@pytest.mark.parametrize("sync", ["barrier", ""])  # MOE_RT_LL_SYNC: barrier or unset (pairwise)
@pytest.mark.parametrize("dedup", ["", "0"])  # MOE_RT_LL_DEDUP: unset (the dedup split) or 0 (per-expert pushes)
@pytest.mark.parametrize("fp8", [None, "float", "pair", "dequant"])
@pytest.mark.parametrize("T", [11, 0])
def test_cuda_host_path_launches_and_arguments(monkeypatch, fp8, T, dedup, sync):
    """An eager low-latency dispatch + combine on CUDA (device stood in for) issues exactly one barrier and
    one kernel each way and two allocations while the earlier handles are kept (a table set for the handle's
    tables, in one; combine's output), and passes each kernel the arguments it takes, by parameter name
    (tables of the right set, the handle's tables, the constants); the split hook, both backwards and a
    second buffer set too; a handle keeps its own tables after later dispatches. MOE_RT_LL_SYNC unset (the
    pairwise default): no barrier launch at all, the kernels' pairwise builds, which also take the barrier slots' peer table and
    the block count (the word after the sets' split epochs)."""
    import ml_dtypes

    tr = _LLTrace(monkeypatch)
    R, me, E, H, Tmax, K = 2, 1, 6, 40, 13, 3
    L, bf = E // R, np.dtype(ml_dtypes.bfloat16)
    monkeypatch.setenv("MOE_RT_LL_DEDUP", dedup)
    monkeypatch.setenv("MOE_RT_LL_SYNC", sync)
    g = tr.group(R, me, E, H, Tmax, K, bf, 2, True)
    dd = int(dedup != "0")
    assert g.dedup is bool(dd)
    pw = sync != "barrier"
    assert g.sync == ("pairwise" if pw else "barrier")
    d, OP = g._transport, _ep_direct.OP_CODES
    sfx = "_pairwise" if pw else ""
    extra = dict(peer_bar=d.bar.table.ptr, count=g._set_epoch.data.ptr + 4 * 2) if pw else {}
    x, idx, w = tr.dev((T, H), bf), tr.dev((T, K), np.int64), tr.dev((T, K), np.float32)
    pair = (tr.array((T, H), np.uint8), tr.array((T, g.num_scales), np.float32))  # CuPy, as the pair is taken
    y, gout = tr.dev((L, R * Tmax, H), bf), tr.dev((T, H), bf)
    gsw = tr.dev((L, R * Tmax), np.float32)
    S = g.num_scales
    consts = dict(state=d.state.ptr, err_word=96, timeout_ns=10**9, R=R, me=me, L=L, Tmax=Tmax, K=K, C=1, H=H)

    def ptr(a, on=True):
        return a.data.ptr if on and T else 0

    def dispatch(b, **kw):
        args = (pair if fp8 == "pair" else x, idx, w)
        return g.dispatch(*args, fp8=fp8 is not None, dequantize=fp8 == "dequant", **kw)

    def tables(h):
        return {k: h._a[k].data.ptr if h._a[k].size else 0
                for k in ("idx", "w", "route", "slot_k", "slot_w", "counts")}

    def want_dispatch(b, h, phases, op="dispatch"):
        t, tab = tables(h), g._tables
        want = dict(consts, err=64, op=OP[op], Tn=T, peer_recv=tab[("recv", b)], peer_route=tab[("route", b)],
                    peer_rw=tab[("rw", b)], peer_flags=d.flags.table.ptr, idx_out=t["idx"], w_out=t["w"],
                    route_out=t["route"], slot_k=t["slot_k"], slot_w=t["slot_w"], counts=t["counts"],
                    phases=phases, flag_base=2 * R * Tmax * b,
                    set_epoch=0 if phases == 3 else g._set_epoch.data.ptr + 4 * b, idx=ptr(idx), w=ptr(w))
        if fp8 is None:
            want.update(x=ptr(x), meta=1, scaled=0, dedup=dd, zero_k=0, recv_route=0)
        else:
            want.update(x=ptr(x, fp8 != "pair"), xq=ptr(pair[0], fp8 == "pair"), xs=ptr(pair[1], fp8 == "pair"),
                        peer_recv_q=tab[("recv_q", b)], peer_recv_s=tab[("recv_s", b)], dequant=int(fp8 == "dequant"),
                        dedup=dd, S=S)
        return dict(want, **extra)

    def barrier(op):  # [the op's barrier launch], none in pairwise mode
        return [] if pw else [("ep_direct_barrier", 1, 32, dict(peer_bar=d.bar.table.ptr, R=R, me=me,
                                                                state=d.state.ptr, timeout_ns=10**9, err_word=96,
                                                                op=OP[op], lo=0, hi=R))]

    kernel = ("ep_ll_dispatch" if fp8 is None else "ep_ll_dispatch_fp8") + sfx
    handles = []
    for b in (0, 1, 0):  # the sets alternate (num_buffers=2)
        out = dispatch(b)
        h = out[-1]
        handles.append(h)
        ev, allocs = tr.take()
        assert allocs == 1  # every earlier handle kept: a new table set (the six tables in one allocation)
        assert ev == barrier("dispatch") + [(kernel, 8, 512, want_dispatch(b, h, 3))]
        rows = out[:-2]
        regions = ["recv"] if fp8 in (None, "dequant") else ["recv_q", "recv_s"]
        assert [r.data.ptr for r in rows] == [g._buf.local + g._offs[(n, b)][0] for n in regions]
        assert out[-2] is h.counts and h.counts.data.ptr == tables(h)["counts"]
        assert h.slot_topk.shape == (L, R * Tmax) and h.slot_topk.data.ptr == tables(h)["slot_k"]
        assert h.slot_weights.dtype == np.float32 and h.slot_weights.data.ptr == tables(h)["slot_w"]
        # the tables lie apart, inside the one allocation
        spans = sorted((p, p + h._a[k].nbytes) for k, p in tables(h).items() if p)
        assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:]))
    # each dispatch has tables of its own: the first handle's stay valid after later dispatches
    assert len({tables(h)["route"] for h in handles}) == 3

    h = handles[1]  # set 1, two dispatches ago
    res = g.combine(h, y)
    ev, allocs = tr.take()
    assert allocs == 1 and res.shape == (T, H)
    t = tables(h)
    combine = dict(consts, y=y.ptr, gws=0, route=t["route"], idx=t["idx"], w=t["w"], slot_w=0,
                   peer_back=g._tables[("back", 1)], peer_bw=g._tables[("bw", 1)], peer_flags=d.flags.table.ptr,
                   out=res.data.ptr if T else 0, grad_w=0, op=OP["combine"], Tn=T,
                   flag_base=2 * R * Tmax, **extra)
    assert ev == barrier("combine") + [("ep_ll_combine" + sfx, 8, 512, combine)]

    gx, gw = g.dispatch_bwd(h, y, gsw)
    ev, allocs = tr.take()
    assert allocs == 2
    assert ev == barrier("dispatch_bwd") + [("ep_ll_combine" + sfx, 8, 512,
                                             dict(combine, gws=gsw.ptr, w=0, out=gx.data.ptr if T else 0,
                                                  grad_w=gw.data.ptr if T else 0, op=OP["dispatch_bwd"]))]

    for yk in (None, tr.dev((L, R * Tmax, H), bf)):
        gy, gw = g.combine_bwd(h, gout, yk)
        ev, allocs = tr.take()
        assert gy.data.ptr == g._buf.local + g._offs[("recv", 1)][0]
        # scaled rows (no expert_out) push per expert; unscaled ones take the dedup split, mapped by the
        # handle's route
        unscaled = dd and yk is not None
        bwd = dict(consts, err=64, op=OP["combine_bwd"], Tn=T, x=ptr(gout), idx=t["idx"], w=t["w"], meta=0,
                   scaled=int(yk is None), dedup=int(unscaled), peer_recv=g._tables[("recv", 1)],
                   peer_route=g._tables[("route", 1)], peer_rw=g._tables[("rw", 1)], peer_flags=d.flags.table.ptr,
                   idx_out=0, w_out=0, route_out=0, slot_k=0, slot_w=0, counts=0, zero_k=t["slot_k"],
                   recv_route=t["route"] if unscaled else 0, phases=3, flag_base=2 * R * Tmax, set_epoch=0,
                   **extra)
        want = barrier("combine_bwd") + [("ep_ll_dispatch" + sfx, 8, 512, bwd)]
        if yk is not None:
            n = L * R * Tmax
            dots = [e for e in ev if e[0] == "ep_ll_slot_dot"][0][3]["dots"]
            want += [("ep_ll_slot_dot", -(-n // 8) if n < 256 else 32, 256,
                      dict(g=gy.data.ptr, y=yk.ptr, slot_k=t["slot_k"], slot_w=t["slot_w"], dots=dots, n=n, H=H))]
            want += barrier("combine_bwd")
            want += [("ep_ll_combine" + sfx, 8, 512, dict(combine, y=0, gws=dots, w=0, out=0,
                                                          grad_w=gw.data.ptr if T else 0, op=OP["combine_bwd"]))]
        assert ev == want and allocs == (0 if yk is None else 2)

    # the split dispatch: barrier and push now, the receive half at the hook, nothing allocated by the hook
    out = dispatch(1, return_recv_hook=True)
    h, hook = out[-2], out[-1]
    ev, allocs = tr.take()
    assert allocs == 1 and ev == barrier("dispatch") + [(kernel, 8, 512, want_dispatch(1, h, 1))]
    hook()
    ev, allocs = tr.take()
    assert allocs == 0 and ev == [(kernel, 8, 512, want_dispatch(1, h, 2))]


@pytest.mark.parametrize("dtype,H,idx_dtype,shift,vec", [("bfloat16", 64, np.int32, 0, "true"),
                                                        ("float16", 36, np.int64, 0, "false"),
                                                        ("float32", 8, np.int64, 4, "false")])
def test_cuda_host_path_round_trip_counts(monkeypatch, dtype, H, idx_dtype, shift, vec):
    """Pinned: an eager round trip (dispatch + combine) issues two launches (the pairwise default: no barrier
    launch; with MOE_RT_LL_SYNC=barrier four), from the first call on; it
    allocates the handle's table set and combine's output on the first call, and only combine's output once
    the group has a free table set (the previous round trip's handle dropped); the kernels' template arguments
    follow the dtype, the id dtype and the 16-byte vector path (rows of a multiple of 16 bytes at 16-byte
    aligned addresses)."""
    import ml_dtypes

    from moe_rt import _jit

    tr = _LLTrace(monkeypatch)
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    g = tr.group(4, 2, 16, H, 8, 2, dt, 1, False)
    x, idx, w = tr.dev((5, H), dt), tr.dev((5, 2), idx_dtype), tr.dev((5, 2), np.float32)
    x.ptr += shift
    y = tr.dev(g._slots_shape(), dt)
    c, i = _jit.ctype(dt), {np.int32: "int", np.int64: "long long"}[idx_dtype]
    for n in range(3):
        h = g.dispatch(x, idx, w)[-1]
        g.combine(h, y)
        del h
        names = list(tr.kernels)
        ev, allocs = tr.take()
        assert names == [f"ep_ll_dispatch_pairwise<{c}, {i}, {vec}>",
                         f"ep_ll_combine_pairwise<{c}, {'true' if dt.itemsize * H % 16 == 0 else 'false'}, false>"]
        assert allocs == (2 if n == 0 else 1)
        assert tr.st.lookups == 0  # the core looks its kernels up (and plans) itself, from the first call on


def test_cuda_host_path_table_sets_reused_only_when_free(monkeypatch):
    """A dispatch's handle tables come from its group's table sets (no allocation once one is free): a set is
    reused by a later dispatch on the same stream only once nothing outside the group refers to it (the
    handle, the returned counts and slot tables, views and pointers derived from them, tables read through
    the handle); never by a dispatch on another stream; beyond _RING sets in use on a stream a dispatch gets
    a set of its own that the group does not keep. Each handle reads its own T tokens."""
    import cupy

    from moe_rt import ep_ll

    tr = _LLTrace(monkeypatch)
    g = tr.group(2, 0, 8, 16, 6, 2, np.float32, 1, False)
    f32 = np.float32

    def dispatch(T=5, stream=None):
        return g.dispatch(tr.dev((T, 16), f32), tr.dev((T, 2), np.int32), tr.dev((T, 2), f32), stream=stream)

    def route(out):
        return out[-1]._ptr("route")

    p0 = route(dispatch())
    tr.take()
    out = dispatch(3)
    assert route(out) == p0 and tr.take()[1] == 0  # the free set again, nothing allocated
    h = out[-1]
    assert h._a["idx"].shape == (3, 2) and h._a["w"].shape == (3, 2) and h._a["idx"].data.ptr == h._ptr("idx")
    assert h.counts is out[1] and h.counts.data.ptr == h._ptr("counts") and h.slot_topk.data.ptr == h._ptr("slot_k")
    del out, h
    holds = [lambda o: o[-1], lambda o: o[1], lambda o: o[-1].slot_topk[1:], lambda o: o[-1].slot_weights.data,
             lambda o: cupy.ndarray((1,), np.int32, o[1].data), lambda o: o[-1]._a["idx"],
             lambda o: o[-1]._a["route"].data + 4, lambda o: o[1].view()]
    for hold in holds:
        out = dispatch()
        assert route(out) == p0
        kept = hold(out)
        del out
        assert route(dispatch()) != p0  # still held: another set
        del kept
        assert route(dispatch()) == p0  # dropped: reused
    assert route(dispatch(stream=11)) != p0  # another stream: its own sets
    assert sorted(g._rings) == [7, 11] and len(g._rings[7]) == 2
    tr.take()
    live = [dispatch() for _ in range(ep_ll._RING + 2)]
    assert len({route(o) for o in live}) == ep_ll._RING + 2 and tr.take()[1] == ep_ll._RING
    assert len(g._rings[7]) == ep_ll._RING
    del live
    assert route(dispatch(0)) == p0 and tr.take()[1] == 0
    out = dispatch(0)
    assert out[-1]._ptr("idx") == 0 and out[-1]._ptr("w") == 0 and out[-1]._a["idx"].shape == (0, 2)


def test_profile_ll_host_tool_runs():
    """tools/profile_ll_host.py (the host time of each op with the device stood in for) runs without a GPU and
    counts the launches and allocations the tests above pin."""
    pytest.importorskip("cupy")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "profile_ll_host.py"), "--calls", "2"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {line[:30].strip(): line[30:].split() for line in r.stdout.splitlines()[1:]}
    # the pairwise default: one launch per op (the split dispatch: push, then the hook's receive)
    assert rows["dispatch+combine"][1:] == ["2", "1"] and rows["dispatch split+hook"][1:] == ["2", "0"]
    assert len(rows) == 9 and all(float(v[0]) > 0 for v in rows.values())


# -- one GPU: the 1-rank group against the reference; graph replay ---------------------------------------

def _gpu_case(rng, cp, L, K, T, Tmax, H, dt):
    xs, idxs, ws = make_case(rng, 1, L, K, (T,), H, dt)
    return xs, idxs, ws, cp.asarray(xs[0]), cp.asarray(idxs[0]), cp.asarray(ws[0])


def _capture_and_replay(cp, step, refresh, check, replays=3):
    """``step()`` captured once as a CUDA graph on a stream of its own (it returns the graph's outputs), then
    replayed ``replays`` times: ``refresh()`` writes new inputs into the arrays the graph reads and returns what
    ``check(outs, new, tag)`` compares the outputs with after the replay."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        outs = step()
        graph = s.end_capture()
    for it in range(replays):
        new = refresh()
        cp.cuda.get_current_stream().synchronize()  # the new inputs written before the replay reads them
        graph.launch(s)
        s.synchronize()
        check(outs, new, f"replay {it}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("L,K,T,Tmax,H", [(5, 3, 7, 9, 13), (8, 8, 128, 128, 256), (3, 2, 0, 4, 8)])
def test_gpu_one_rank_combine_partials(rng, dtype, L, K, T, Tmax, H):
    """One rank, combine_partials=True: combine bitwise the reference's rank-partial combine (expert rows of
    invalid slots NaN; the back buffer poisoned), twice; then captured with dispatch and replayed with new
    routing."""
    import cupy as cp

    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt, combine_partials=True)
    try:
        for _ in range(2):
            xs, idxs, ws, x, idx, w = _gpu_case(rng, cp, L, K, T, Tmax, H, dt)
            _, _, h = g.dispatch(x, idx, w)
            rh = ref.dispatch(xs, idxs, ws, L, Tmax)[0][2]
            y = rng.standard_normal((L, Tmax, H)).astype(dt)
            y[rh["slot_k"] < 0] = np.nan
            g._view("back", 0, (g._offs[("back", 0)][1],), np.uint8).fill(255)
            out = g.combine(h, cp.asarray(y))
            np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint8),
                                          ref.combine_partials([rh], [y])[0].view(np.uint8))
            g.synchronize()
        ys = cp.asarray(rng.standard_normal((L, Tmax, H)).astype(dt))

        def step():
            _, _, h = g.dispatch(x, idx, w)
            return g.combine(h, ys)

        def refresh():
            xs, idxs, ws = make_case(rng, 1, L, K, (T,), H, dt)
            x[...], idx[...], w[...] = cp.asarray(xs[0]), cp.asarray(idxs[0]), cp.asarray(ws[0])
            y = rng.standard_normal((L, Tmax, H)).astype(dt)
            ys[...] = cp.asarray(y)
            return xs, idxs, ws, y

        def check(out, new, tag):
            xs, idxs, ws, y = new
            rh = ref.dispatch(xs, idxs, ws, L, Tmax)[0][2]
            np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint8),
                                          ref.combine_partials([rh], [y])[0].view(np.uint8), tag)

        _capture_and_replay(cp, step, refresh, check)
    finally:
        g.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("L,K,T,Tmax,H", [(5, 3, 7, 9, 13), (8, 4, 128, 128, 256), (3, 2, 0, 4, 8)])
@pytest.mark.parametrize("dedup,transport", [(True, "auto"), (False, "auto"), (True, "nccl")])
def test_gpu_one_rank_against_reference(rng, dtype, L, K, T, Tmax, H, dedup, transport):
    # one rank: with dedup every token's row arrives once and the receiving side copies it to its other experts;
    # transport="nccl": the NCCL transport's kernels (one rank: no exchange between them)
    import cupy as cp

    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt, dedup=dedup, transport=transport)
    try:
        for _ in range(2):  # the second call over buffers the first one filled
            xs, idxs, ws, x, idx, w = _gpu_case(rng, cp, L, K, T, Tmax, H, dt)
            recv, counts, h = g.dispatch(x, idx, w)
            rx, rc, rh = ref.dispatch(xs, idxs, ws, L, Tmax)[0]
            valid = rh["slot_k"] >= 0
            np.testing.assert_array_equal(cp.asnumpy(recv)[valid].view(np.uint8), rx[valid].view(np.uint8))
            np.testing.assert_array_equal(cp.asnumpy(counts), rc)
            np.testing.assert_array_equal(cp.asnumpy(h.slot_topk), rh["slot_k"])
            np.testing.assert_array_equal(cp.asnumpy(h.slot_weights), rh["slot_w"])
            y = rng.standard_normal((L, Tmax, H)).astype(dt)
            out = g.combine(h, cp.asarray(y))
            np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint8), ref.combine([rh], [y])[0].view(np.uint8))
            gr = rng.standard_normal((L, Tmax, H)).astype(dt)
            gwr = rng.standard_normal((L, Tmax)).astype(np.float32)
            gx, gw = g.dispatch_bwd(h, cp.asarray(gr), cp.asarray(gwr))
            wx, ww = ref.dispatch_bwd([rh], [gr], [gwr])[0]
            np.testing.assert_array_equal(cp.asnumpy(gx).view(np.uint8), wx.view(np.uint8))
            np.testing.assert_array_equal(cp.asnumpy(gw), ww)
            go = rng.standard_normal((T, H)).astype(dt)
            gy, gw = g.combine_bwd(h, cp.asarray(go), cp.asarray(y))
            wy, ww = ref.combine_bwd([rh], [go], [y])[0]
            np.testing.assert_array_equal(cp.asnumpy(gy).view(np.uint8), wy.view(np.uint8))  # zero at invalid
            np.testing.assert_allclose(cp.asnumpy(gw), ww, rtol=1e-5, atol=1e-5)
            gy2, _ = g.combine_bwd(h, cp.asarray(go))
            np.testing.assert_array_equal(cp.asnumpy(gy2).view(np.uint8), wy.view(np.uint8))
            g.synchronize()
    finally:
        g.close()


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["auto", "nccl"])
def test_gpu_one_rank_bad_ids_raise_at_synchronize(rng, transport):
    import cupy as cp

    g = LowLatencyGroup(None, 4, 8, 4, topk=2, dtype=np.float32, transport=transport)
    try:
        g.dispatch(cp.zeros((3, 8), np.float32), cp.asarray(np.array([[0, 9], [1, 2], [3, -1]], np.int32)),
                   cp.ones((3, 2), np.float32))
        with pytest.raises(ValueError, match=r"topk_idx: expert ids must be in \[-1, num_experts=4\), got 9"):
            g.synchronize()
    finally:
        g.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dedup", [True, False])
def test_gpu_one_rank_graph_replay_with_new_routing(rng, dedup):
    import cupy as cp

    dt = bf16()
    L, K, T, Tmax, H = 6, 3, 11, 16, 64
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt, dedup=dedup)
    try:
        xs, idxs, ws, x, idx, w = _gpu_case(rng, cp, L, K, T, Tmax, H, dt)
        y = cp.asarray(rng.standard_normal((L, Tmax, H)).astype(dt))
        g.combine(g.dispatch(x, idx, w)[2], y)  # buffers and kernels before capture

        def step():
            recv, counts, h = g.dispatch(x, idx, w)
            return recv, counts, g.combine(h, y)

        def refresh():
            xs, idxs, ws = make_case(rng, 1, L, K, (T,), H, dt)
            x[...], idx[...], w[...] = cp.asarray(xs[0]), cp.asarray(idxs[0]), cp.asarray(ws[0])
            return xs, idxs, ws

        def check(outs, new, tag):
            recv, counts, out = outs
            rx, rc, rh = ref.dispatch(*new, L, Tmax)[0]
            np.testing.assert_array_equal(cp.asnumpy(counts), rc, tag)
            valid = rh["slot_k"] >= 0
            np.testing.assert_array_equal(cp.asnumpy(recv)[valid].view(np.uint8), rx[valid].view(np.uint8), tag)
            np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint8),
                                          ref.combine([rh], [cp.asnumpy(y)])[0].view(np.uint8), tag)

        _capture_and_replay(cp, step, refresh, check)
    finally:
        g.close()


@pytest.mark.gpu
def test_gpu_one_rank_table_sets_reused_and_torch(rng):
    """Handles kept across later dispatches keep their own tables (combine of an older handle after newer
    dispatches, counts kept without the handle), dispatches after dropped handles reuse table sets with
    results bit for bit the reference's (T changing between them), and torch tensors in (imported without
    CuPy arrays; combine's output from torch's allocator) give the CuPy results bit for bit."""
    import cupy as cp

    torch = _torch_cuda()
    dt = bf16()
    L, K, Tmax, H = 5, 3, 12, 64
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt)
    y = rng.standard_normal((L, Tmax, H)).astype(dt)
    yc = cp.asarray(y)

    def check(h, counts, rh, rc):
        np.testing.assert_array_equal(cp.asnumpy(counts), rc)
        np.testing.assert_array_equal(cp.asnumpy(h.slot_topk), rh["slot_k"])
        np.testing.assert_array_equal(cp.asnumpy(h.slot_weights), rh["slot_w"])
        np.testing.assert_array_equal(cp.asnumpy(g.combine(h, yc)).view(np.uint8),
                                      ref.combine([rh], [y])[0].view(np.uint8))

    try:
        kept = []
        for T in (7, 12, 3, 0, 9):
            xs, idxs, ws, x, idx, w = _gpu_case(rng, cp, L, K, T, Tmax, H, dt)
            _, counts, h = g.dispatch(x, idx, w)
            rx, rc, rh = ref.dispatch(xs, idxs, ws, L, Tmax)[0]
            kept.append((h, counts, rh, rc))
        for h, counts, rh, rc in kept:  # each handle's own tables, after every later dispatch
            check(h, counts, rh, rc)
        only_counts = kept[1][1], kept[1][3]
        del kept, h, counts
        for T in (12, 1, 8, 12):  # reused sets
            xs, idxs, ws, x, idx, w = _gpu_case(rng, cp, L, K, T, Tmax, H, dt)
            recv, counts, h = g.dispatch(x, idx, w)
            rx, rc, rh = ref.dispatch(xs, idxs, ws, L, Tmax)[0]
            valid = rh["slot_k"] >= 0
            np.testing.assert_array_equal(cp.asnumpy(recv)[valid].view(np.uint8), rx[valid].view(np.uint8))
            check(h, counts, rh, rc)
            del recv, counts, h
        np.testing.assert_array_equal(cp.asnumpy(only_counts[0]), only_counts[1])  # never reused while kept
        if torch is not None:
            xs, idxs, ws, x, idx, w = _gpu_case(rng, cp, L, K, 10, Tmax, H, dt)
            recv, counts, h = g.dispatch(x, idx, w)
            out = cp.asnumpy(g.combine(h, yc))
            xt, it, wt = (torch.from_dlpack(a) for a in (x, idx, w))
            recv_t, counts_t, h_t = g.dispatch(xt, it, wt)
            assert isinstance(recv_t, torch.Tensor) and isinstance(counts_t, torch.Tensor)
            np.testing.assert_array_equal(counts_t.cpu().numpy(), cp.asnumpy(counts))
            np.testing.assert_array_equal(h_t.slot_topk.cpu().numpy(), cp.asnumpy(h.slot_topk))
            out_t = g.combine(h_t, torch.from_dlpack(yc))
            assert isinstance(out_t, torch.Tensor) and out_t.shape == (10, H)
            torch.cuda.synchronize()
            np.testing.assert_array_equal(out_t.view(torch.int16).cpu().numpy(), out.view(np.int16))
        g.synchronize()
    finally:
        g.close()


@pytest.mark.gpu
def test_gpu_torch_first_dispatch_under_capture_on_a_side_stream(rng):
    """A torch caller's first dispatch on torch's side stream (a light call: CuPy's stream entered only when
    the op asks for the call's stream) while that stream is captured: the group's set-up sees the capture on
    the call's stream and refuses with its message (nothing queued, the capture stays valid); after the
    capture the same dispatch runs on that stream and gives the reference's counts."""
    import cupy as cp

    torch = _torch_cuda()
    if torch is None:
        pytest.skip("needs torch with CUDA")
    L, K, T, Tmax, H = 4, 2, 9, 16, 32
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=np.float32)
    try:
        xs, idxs, ws, x, idx, w = _gpu_case(rng, cp, L, K, T, Tmax, H, np.float32)
        xt, it, wt = (torch.from_dlpack(a) for a in (x, idx, w))
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            graph.capture_begin()
            with pytest.raises(RuntimeError, match="run one op before CUDA-graph capture"):
                g.dispatch(xt, it, wt)
            graph.capture_end()  # raises if the refused dispatch touched another stream during the capture
            recv, counts, h = g.dispatch(xt, it, wt)
        side.synchronize()
        np.testing.assert_array_equal(counts.cpu().numpy(), ref.dispatch(xs, idxs, ws, L, Tmax)[0][1])
        g.synchronize()
    finally:
        g.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dedup", [True, False])
def test_gpu_one_rank_split_dispatch_two_in_flight(rng, dedup):
    import cupy as cp

    dt = bf16()
    L, K, T, Tmax, H = 5, 3, 13, 16, 136
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt, num_buffers=2, dedup=dedup)
    try:
        cases = [_gpu_case(rng, cp, L, K, T, Tmax, H, dt) for _ in range(2)]
        Ys = [rng.standard_normal((L, Tmax, H)).astype(dt) for _ in range(2)]
        for _ in range(2):  # the second round over buffers (and flags) the first one used
            got = [g.dispatch(*c[3:], return_recv_hook=True) for c in cases]
            assert [h.buffer_set for _, _, h, _ in got] == [0, 1]
            with pytest.raises(ValueError, match="receive hook has not run"):
                g.combine(got[0][2], cp.asarray(Ys[0]))
            for *_, hook in got:
                hook()
            with pytest.raises(ValueError, match="already called"):
                got[0][3]()
            for (recv, counts, h, _), c, y in zip(got, cases, Ys):
                rx, rc, rh = ref.dispatch(c[0], c[1], c[2], L, Tmax)[0]
                valid = rh["slot_k"] >= 0
                np.testing.assert_array_equal(cp.asnumpy(recv)[valid].view(np.uint8), rx[valid].view(np.uint8))
                np.testing.assert_array_equal(cp.asnumpy(counts), rc)
                np.testing.assert_array_equal(cp.asnumpy(h.slot_topk), rh["slot_k"])
                out = g.combine(h, cp.asarray(y))
                np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint8),
                                              ref.combine([rh], [y])[0].view(np.uint8))
            g.synchronize()
    finally:
        g.close()
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt)  # one set: a second dispatch waits for the hook
    try:
        c = cases[0]
        *_, hook = g.dispatch(*c[3:], return_recv_hook=True)
        with pytest.raises(ValueError, match="buffer set 0 still waits for the receive hook"):
            g.dispatch(*c[3:])
        hook()
        g.dispatch(*c[3:])
        g.synchronize()
    finally:
        g.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,H", [("bfloat16", 7168), ("float32", 200), ("float16", 13)])
def test_gpu_one_rank_dedup_on_and_off_bitwise_equal(rng, dtype, H):
    """The same inputs through a group with the dedup split and one with per-expert pushes: valid rows, counts,
    slot tables, FP8 codes and scales (a uint8 pair), dequantized rows, combine_bwd's rows (zero at invalid
    slots) bitwise equal between the two and to the reference; H = 13 and 200 take the scalar paths."""
    import cupy as cp

    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    L, K, T, Tmax = 7, 5, 37, 40
    groups = [LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt, fp8=True, dedup=d) for d in (True, False)]
    try:
        for _ in range(2):  # the second round over buffers the first filled
            xs, idxs, ws = fp8_case(rng, 1, L, K, (T,), H, dt)
            x, idx, w = cp.asarray(xs[0]), cp.asarray(idxs[0]), cp.asarray(ws[0])
            xq, xsc = moe_rt.quantize_fp8(xs[0])
            pair = (cp.asarray(xq.view(np.uint8)), cp.asarray(xsc))
            go = cp.asarray(rng.standard_normal((T, H)).astype(dt))
            y = cp.asarray(rng.standard_normal((L, Tmax, H)).astype(dt))
            rx, rc, rh = ref.dispatch(xs, idxs, ws, L, Tmax)[0]
            rq, rs, _, _ = ref.dispatch_fp8(xs, idxs, ws, L, Tmax)[0]
            valid = rh["slot_k"] >= 0
            want = [rx[valid], rc, rh["slot_k"], rh["slot_w"], rq[valid], rs[valid],
                    fp8_dequantized(rq, rs, rh["slot_k"], dt)[valid],
                    ref.combine_bwd([rh], [cp.asnumpy(go)], [cp.asnumpy(y)])[0][0]]
            got = []
            for g in groups:
                recv, counts, h = g.dispatch(x, idx, w)
                one = [cp.asnumpy(recv)[valid], cp.asnumpy(counts), cp.asnumpy(h.slot_topk),
                       cp.asnumpy(h.slot_weights)]
                q, sc, _, _ = g.dispatch(pair, idx, w, fp8=True)
                one += [cp.asnumpy(q)[valid], cp.asnumpy(sc)[valid]]
                yd, _, _ = g.dispatch(x, idx, w, fp8=True, dequantize=True)
                one.append(cp.asnumpy(yd)[valid])
                gy, _ = g.combine_bwd(h, go, y)
                one.append(cp.asnumpy(gy))
                g.synchronize()
                got.append(one)
            for name, a, b, c in zip(("rows", "counts", "slot_k", "slot_w", "codes", "scales", "dequantized",
                                      "combine_bwd"), got[0], got[1], want):
                assert a.shape == b.shape == c.shape and a.dtype.itemsize == np.dtype(c.dtype).itemsize, name
                assert (np.ascontiguousarray(a).view(np.uint8) == np.ascontiguousarray(b).view(np.uint8)).all(), name
                assert (np.ascontiguousarray(a).view(np.uint8) == np.ascontiguousarray(c).view(np.uint8)).all(), name
    finally:
        for g in groups:
            g.close()


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def flushed(y):
    """``y`` with its fp32-subnormal values zeroed: what the GPU's fp32 arithmetic (compiled with -ftz=true,
    docs/design.md §3) reads them as. Combine checks over rows holding subnormals compare against the
    reference of the flushed rows, by value (a flushed negative is -0)."""
    y = np.array(y)
    y[np.abs(y.astype(np.float32)) < np.float32(2.0 ** -126)] = 0
    return y


def fp8_dequantized(rq, rs, slot_k, dt):
    """The reference's received FP8 pair ``[L, R*Tmax, ...]`` dequantized in ``dt`` at the valid slots (only
    those rows are converted), zero elsewhere."""
    valid = slot_k >= 0
    y = np.zeros(rq.shape, dt)
    y[valid] = moe_rt.dequantize_fp8(rq[valid], rs[valid], dt)
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("L,K,T,Tmax,H", [(5, 3, 7, 9, 13), (8, 4, 128, 128, 256), (3, 2, 0, 4, 16),
                                          (4, 3, 33, 40, 7168), (6, 2, 9, 9, 200)])
@pytest.mark.parametrize("dedup", [True, False])
def test_gpu_one_rank_fp8_against_reference(rng, dtype, L, K, T, Tmax, H, dedup):
    """FP8 dispatch on one GPU, bit for bit: a float x quantized in the push (dequantized on receipt; with torch
    also the e4m3 codes themselves, equal to the quantize_fp8 kernel's), a uint8 pair pushed as is; counts and
    slot tables as the reference's; combine and both backwards after it as after a float dispatch. H = 13 and
    200 run the scalar path (H % 16 != 0)."""
    import cupy as cp

    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    torch = _torch_cuda()
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt, fp8=True, dedup=dedup)
    try:
        for _ in range(2):  # the second call over buffers the first one filled
            xs, idxs, ws = fp8_case(rng, 1, L, K, (T,), H, dt)
            rq, rs, rc, rh = ref.dispatch_fp8(xs, idxs, ws, L, Tmax)[0]
            sk = rh["slot_k"]
            x, idx, w = cp.asarray(xs[0]), cp.asarray(idxs[0]), cp.asarray(ws[0])
            with pytest.raises(TypeError, match="which CuPy cannot hold"):
                g.dispatch(x, idx, w, fp8=True)
            y, counts, h = g.dispatch(x, idx, w, fp8=True, dequantize=True)
            assert y.dtype == dt and y.shape == (L, Tmax, H)
            np.testing.assert_array_equal(fp8_valid_rows(cp.asnumpy(y), sk),
                                          fp8_valid_rows(fp8_dequantized(rq, rs, sk, dt), sk))
            np.testing.assert_array_equal(cp.asnumpy(counts), rc)
            np.testing.assert_array_equal(cp.asnumpy(h.slot_topk), sk)
            np.testing.assert_array_equal(cp.asnumpy(h.slot_weights), rh["slot_w"])
            xq, xsc = moe_rt.quantize_fp8(xs[0])
            q, sc, counts, _ = g.dispatch((cp.asarray(xq.view(np.uint8)), cp.asarray(xsc)), idx, w, fp8=True)
            assert q.dtype == np.uint8 and sc.dtype == np.float32 and sc.shape == (L, Tmax, -(-H // 128))
            np.testing.assert_array_equal(fp8_valid_rows(cp.asnumpy(q), sk), fp8_valid_rows(rq, sk))
            np.testing.assert_array_equal(fp8_valid_rows(cp.asnumpy(sc), sk), fp8_valid_rows(rs, sk))
            np.testing.assert_array_equal(cp.asnumpy(counts), rc)
            if torch is not None:
                tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
                xt = torch.from_numpy(xs[0].astype(np.float32)).cuda().to(tdt)
                it, wt = torch.from_numpy(idxs[0]).cuda(), torch.from_numpy(ws[0]).cuda()
                q, sc, counts, _ = g.dispatch(xt, it, wt, fp8=True)
                assert q.dtype == torch.float8_e4m3fn and sc.dtype == torch.float32
                qn, sn = q.view(torch.uint8).cpu().numpy(), sc.cpu().numpy()
                np.testing.assert_array_equal(fp8_valid_rows(qn, sk), fp8_valid_rows(rq, sk))
                np.testing.assert_array_equal(fp8_valid_rows(sn, sk), fp8_valid_rows(rs, sk))
                if T:  # the push's quantization is the quantize_fp8 kernel's: slot (l, t) holds token t
                    qk, skk = moe_rt.quantize_fp8(xt)
                    ll, tt = np.nonzero(sk >= 0)
                    np.testing.assert_array_equal(qn[ll, tt], qk.view(torch.uint8).cpu().numpy()[tt])
                    np.testing.assert_array_equal(sn[ll, tt].view(np.uint32), skk.cpu().numpy()[tt].view(np.uint32))
                q2, _, _, _ = g.dispatch((moe_rt.quantize_fp8(xt)[0], torch.from_numpy(xsc).cuda()), it, wt, fp8=True)
                assert q2.dtype == torch.float8_e4m3fn
                np.testing.assert_array_equal(fp8_valid_rows(q2.view(torch.uint8).cpu().numpy(), sk),
                                              fp8_valid_rows(rq, sk))
            # combine and both backwards with the handle of the FP8 dispatch
            yo = rng.standard_normal((L, Tmax, H)).astype(dt)
            out = g.combine(h, cp.asarray(yo))
            np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint8), ref.combine([rh], [yo])[0].view(np.uint8))
            gx, _ = g.dispatch_bwd(h, cp.asarray(yo))
            np.testing.assert_array_equal(cp.asnumpy(gx).view(np.uint8),
                                          ref.dispatch_bwd([rh], [yo])[0][0].view(np.uint8))
            go = rng.standard_normal((T, H)).astype(dt)
            gy, _ = g.combine_bwd(h, cp.asarray(go))
            np.testing.assert_array_equal(cp.asnumpy(gy).view(np.uint8),
                                          ref.combine_bwd([rh], [go])[0][0].view(np.uint8))
            g.synchronize()
    finally:
        g.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dedup", [True, False])
def test_gpu_one_rank_fp8_graph_replay_and_split(rng, dedup):
    """FP8 dispatch (dequantized) + combine captured once and replayed with new tokens and routing; two
    micro-batches in flight through receive hooks (num_buffers=2: an FP8 pair and a quantized float x), eager
    and replayed from a graph."""
    import cupy as cp

    dt = bf16()
    L, K, T, Tmax, H = 6, 3, 11, 16, 384
    g = LowLatencyGroup(None, L, H, Tmax, topk=K, dtype=dt, fp8=True, num_buffers=2, dedup=dedup)
    try:
        xs, idxs, ws = fp8_case(rng, 1, L, K, (T,), H, dt)
        x, idx, w = cp.asarray(xs[0]), cp.asarray(idxs[0]), cp.asarray(ws[0])
        q0, s0 = moe_rt.quantize_fp8(xs[0])
        xq, xsc = cp.asarray(q0.view(np.uint8)), cp.asarray(s0)  # CuPy holds FP8 codes as uint8
        yo = cp.asarray(rng.standard_normal((L, Tmax, H)).astype(dt))

        def check(outs, host, tag):
            (qa, _), cb, yb, oa, ob = outs
            rq, rs, rc, rh = ref.dispatch_fp8(*host, L, Tmax)[0]
            sk = rh["slot_k"]
            want_y = fp8_dequantized(rq, rs, sk, dt)
            np.testing.assert_array_equal(fp8_valid_rows(cp.asnumpy(qa), sk), fp8_valid_rows(rq, sk), tag)
            np.testing.assert_array_equal(fp8_valid_rows(cp.asnumpy(yb), sk), fp8_valid_rows(want_y, sk), tag)
            np.testing.assert_array_equal(cp.asnumpy(cb), rc, tag)
            np.testing.assert_array_equal(cp.asnumpy(oa).view(np.uint8),
                                          ref.combine([rh], [cp.asnumpy(yo)])[0].view(np.uint8), tag)
            # want_y holds subnormal rows (the FP8 edge cases): the GPU's fp32 arithmetic flushes them
            np.testing.assert_array_equal(cp.asnumpy(ob).astype(np.float32),
                                          ref.combine([rh], [flushed(want_y)])[0].astype(np.float32), tag)

        def split_step():
            (qa, sa, _, ha, hook_a) = g.dispatch((xq, xsc), idx, w, fp8=True, return_recv_hook=True)
            (yb, cb, hb, hook_b) = g.dispatch(x, idx, w, fp8=True, dequantize=True, return_recv_hook=True)
            assert ha.buffer_set != hb.buffer_set
            hook_a()
            hook_b()
            return (qa, sa), cb, yb, g.combine(ha, yo), g.combine(hb, yb)

        def refresh():
            xs, idxs, ws = fp8_case(rng, 1, L, K, (T,), H, dt)
            x[...], idx[...], w[...] = cp.asarray(xs[0]), cp.asarray(idxs[0]), cp.asarray(ws[0])
            q0, s0 = moe_rt.quantize_fp8(xs[0])
            xq[...], xsc[...] = cp.asarray(q0.view(np.uint8)), cp.asarray(s0)
            return xs, idxs, ws

        check(split_step(), (xs, idxs, ws), "eager")
        g.synchronize()
        _capture_and_replay(cp, split_step, refresh, check)
        g.synchronize()
    finally:
        g.close()


# -- several GPUs: tests/ep_ll_worker.py ------------------------------------------------------------------

def _gpu_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def _run_worker(what, n, timeout=240, sync="barrier", transport="auto"):
    """tests/ep_ll_worker.py ``what`` on n ranks, every rank's groups made with MOE_RT_LL_SYNC=sync and
    MOE_RT_LL_TRANSPORT=transport."""
    if n > _gpu_count():
        pytest.skip(f"needs {n} CUDA GPUs")
    env = dict(os.environ, MOE_RT_EP_TIMEOUT="60", MOE_RT_LL_SYNC=sync, MOE_RT_LL_TRANSPORT=transport)
    r = subprocess.run([sys.executable, str(LAUNCH), "-n", str(n), "--timeout", str(timeout),
                        str(ROOT / "tests" / "ep_ll_worker.py"), what], capture_output=True, text=True, env=env,
                       timeout=timeout + 60)
    print(r.stdout[-20000:])
    print(r.stderr[-5000:])
    return r


@pytest.mark.multi_gpu
@pytest.mark.parametrize("sync", ["barrier", "pairwise"])  # MOE_RT_LL_SYNC of every rank
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("what", ["correctness", "graph", "split", "fp8"])
def test_multi_gpu_low_latency(what, n, sync):
    # correctness: dispatch, combine, dispatch_bwd, combine_bwd against the NumPy R-rank reference (fp32,
    # fp16, bf16; odd shapes, T = 0 ranks, duplicates, holes), run to run bitwise; graph: dispatch + combine
    # captured once and replayed with new routing and tokens, against the reference each time; split: two
    # micro-batches in flight through receive hooks (num_buffers=2), eager and replayed from a graph; fp8:
    # FP8 dispatch (quantized in the push, and pre-quantized pairs) bitwise against the reference, combine and
    # backwards after it, split hooks and graph replay; each with dedup on and off (LowLatencyGroup(dedup=)),
    # the two runs' outputs bitwise equal
    r = _run_worker(what, n, timeout=480, sync=sync)  # every case twice: dedup on and off
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout


@pytest.mark.multi_gpu
@pytest.mark.parametrize("sync", ["barrier", "pairwise"])
@pytest.mark.parametrize("n", [2, 4])
def test_multi_gpu_low_latency_combine_partials(n, sync):
    # LowLatencyGroup(combine_partials=True): combine bitwise the reference's rank-partial combine (fp32, fp16,
    # bf16; odd H, T = 0 ranks, duplicates, holes, K above and below R), poisoned expert rows and back buffer,
    # run to run bitwise, dedup on and off; backwards unchanged; graph replay with new routing; ranks
    # disagreeing on combine_partials refused on every rank
    r = _run_worker("partials", n, timeout=480, sync=sync)
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout


@pytest.mark.multi_gpu
@pytest.mark.parametrize("sync", ["barrier", "pairwise"])
@pytest.mark.parametrize("n", [2, 4])
def test_multi_gpu_low_latency_dead_peer_times_out(n, sync):
    # pairwise: the live ranks' dispatch waits for the dead rank's announce and gives up within the timeout
    r = _run_worker("dead_peer", n, timeout=120, sync=sync)
    assert r.returncode == 0 and "[rank 0] DEAD PEER OK" in r.stdout


@pytest.mark.multi_gpu
@pytest.mark.parametrize("n", [2, 4])
def test_multi_gpu_low_latency_transports_bitwise_equal(n):
    # LowLatencyGroup(transport="direct") and transport="nccl" on the same inputs: every output bitwise equal
    # (and each against the reference), per-expert combine and rank partials; ranks asking for different
    # transports refused on every rank
    r = _run_worker("transports", n, timeout=480)
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout


@pytest.mark.multi_gpu
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("what", ["correctness", "graph", "split", "fp8", "partials", "jax"])
def test_multi_gpu_low_latency_nccl_transport(what, n):
    # every worker case of the direct transport's tests on the NCCL transport (MOE_RT_LL_TRANSPORT=nccl):
    # against the reference, graph replay with new routing, split hooks with two buffer sets, FP8, rank
    # partials, moe_rt.jax's XLA custom calls
    r = _run_worker(what, n, timeout=480, transport="nccl")
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout


@pytest.mark.multi_gpu
@pytest.mark.parametrize("n", [2, 4])
def test_multi_gpu_low_latency_nccl_dead_peer_times_out(n):
    # the live ranks' NCCL all-gather never ends: synchronize gives up within the timeout, aborts the
    # communicator and raises TimeoutError; close does not hang
    r = _run_worker("dead_peer", n, timeout=120, transport="nccl")
    assert r.returncode == 0 and "[rank 0] DEAD PEER OK" in r.stdout
