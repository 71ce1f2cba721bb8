"""Expert parallelism: the R-rank NumPy reference (invariants, brute force), EpGroup's CPU path and its
validation, the handle layout against include/moe_rt/moe_rt.h, the launcher and the shared-file
bootstrap. The multi-GPU tests run tests/ep_worker.py under tools/launch.py on 2 GPUs."""
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from moe_rt import _handle
from moe_rt.ep import EpGroup, Handle
from moe_rt.reference import ep as ref

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "tools" / "launch.py"


# -- routing generators (shared with tests/ep_worker.py) ---------------------------------------------------

def make_routing(rng, T, E, K, kind="uniform"):
    """[T,K] int32 routing: 'uniform' (distinct experts per token), 'skewed' (most tokens on few experts),
    'one' (every token to expert 0 and nothing else), 'holes' (uniform with -1 entries)."""
    if T == 0:
        return np.zeros((0, K), np.int32)
    if kind == "one":
        idx = np.full((T, K), -1, np.int32)
        idx[:, 0] = 0
        return idx
    if kind == "skewed":
        p = np.exp(-np.arange(E) / max(1.0, E / 8))
        scores = rng.random((T, E)) * p[None, :]
    else:
        scores = rng.random((T, E))
    idx = np.argsort(-scores, axis=1)[:, :K].astype(np.int32)
    if kind == "holes":
        idx[rng.random((T, K)) < 0.3] = -1
    return idx


def _case(rng, R, E, K, Ts, kind, H=6, dtype=np.float32):
    idx = [make_routing(rng, T, E, K, kind) for T in Ts]
    x = [rng.standard_normal((T, H)).astype(dtype) for T in Ts]
    w = [rng.random((T, K)).astype(np.float32) for T in Ts]
    return idx, x, w


CASES = [
    (1, 4, 2, (5,), "uniform"),
    (2, 8, 3, (7, 4), "uniform"),
    (2, 8, 3, (9, 0), "holes"),
    (4, 8, 4, (6, 3, 0, 5), "skewed"),
    (4, 16, 5, (8, 8, 8, 8), "holes"),
    (4, 8, 2, (5, 7, 1, 4), "one"),
    (2, 4, 4, (6, 6), "uniform"),   # K > L
]


def _dot(a, b):
    return float(np.vdot(np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()))


# -- reference: layout and counts against brute force -----------------------------------------------------

@pytest.mark.parametrize("align", [1, 4])
@pytest.mark.parametrize("R,E,K,Ts,kind", CASES)
def test_reference_layout_brute_force(rng, R, E, K, Ts, kind, align):
    idx, x, w = _case(rng, R, E, K, Ts, kind)
    L = E // R
    hs = ref.prepare(idx, E, align_size=align)
    outs = ref.dispatch(hs, x, w)
    for d, (h, (rx, rw, tpe)) in enumerate(zip(hs, outs)):
        # dedup: each token once per destination rank; counts = brute force
        for s in range(R):
            want = [t for t in range(Ts[s]) if any(e >= 0 and e // L == d for e in idx[s][t])]
            assert hs[s]["send_counts"][d] == len(want)
            assert list(hs[s]["send_tokens"][d]) == want
            assert h["recv_counts"][s] == len(want)
        brute = np.zeros(L, np.int64)
        for s in range(R):
            for e in idx[s].ravel():
                if e >= 0 and e // L == d:
                    brute[e % L] += 1
        padded = (brute + align - 1) // align * align
        assert np.array_equal(tpe, padded if align > 1 else brute)
        assert np.array_equal(h["plan"]["counts"], brute)
        # every expert-major row holds the right token and weight; others are zero
        seen = 0
        src = h["plan"]["src_slot"]
        seg = h["plan"]["seg_start"]
        for n in range(h["num_rows"]):
            if src[n] < 0:
                assert not rx[n].any() and rw[n] == 0
                continue
            r, k = divmod(int(src[n]), K)
            s, t = int(h["recv_src"][r]), int(h["recv_tok"][r])
            l_e = int(np.searchsorted(seg, n, side="right") - 1)
            assert idx[s][t, k] == d * L + l_e
            assert np.array_equal(rx[n], x[s][t]) and rw[n] == w[s][t, k]
            seen += 1
        assert seen == brute.sum()
        # tokens ascending in (src, t) order inside each expert
        for l_e in range(L):
            rows = [int(src[n]) // K for n in range(seg[l_e], seg[l_e + 1]) if src[n] >= 0]
            keys = [(int(h["recv_src"][r]), int(h["recv_tok"][r])) for r in rows]
            assert keys == sorted(keys)
        assert h["num_rows"] >= seg[L] and not h["overflow"]


@pytest.mark.parametrize("R,E,K,Ts,kind", CASES)
@pytest.mark.parametrize("mode", ["exact", "capacity"])
def test_reference_adjoint_and_backward(rng, R, E, K, Ts, kind, mode):
    idx, x, w = _case(rng, R, E, K, Ts, kind)
    kw = {} if mode == "exact" else {"pair_capacity": max(Ts) or 1, "capacity": 10 ** 6}
    hs = ref.prepare(idx, E, **kw)
    outs = ref.dispatch(hs, x, w)
    y = [rng.standard_normal(o[0].shape) for o in outs]
    gout = [rng.standard_normal(xi.shape) for xi in x]
    gw = [rng.standard_normal(o[1].shape).astype(np.float32) for o in outs]
    # <D x, y> == <x, D^T y>  (unweighted combine is D^T)
    lhs = sum(_dot(o[0], yi) for o, yi in zip(outs, y))
    comb = ref.combine(hs, y, weighted=False)
    assert np.isclose(lhs, sum(_dot(xi, ci) for xi, ci in zip(x, comb)), rtol=1e-10, atol=1e-10)
    # dispatch_bwd: <D x, g> + <recv_w, g_w> == <x, grad_x> + <w, grad_w>
    bwd = ref.dispatch_bwd(hs, y, gw)
    lhs = sum(_dot(o[0], yi) + _dot(o[1], gi) for o, yi, gi in zip(outs, y, gw))
    rhs = sum(_dot(xi, b[0]) + _dot(wi, b[1]) for xi, wi, b in zip(x, w, bwd))
    assert np.isclose(lhs, rhs, rtol=1e-6, atol=1e-6)
    # dispatch_bwd data part == unweighted combine
    for b, c in zip(bwd, comb):
        assert np.allclose(b[0], c)
    # weighted combine and combine_bwd: <C_w y, g> == <y, C_w^T g>; sum_n w_n grad_w_n == <C_w y, g>
    cw = ref.combine(hs, y, weighted=True)
    cb = ref.combine_bwd(hs, gout, y, weighted=True)
    lhs = sum(_dot(c, g) for c, g in zip(cw, gout))
    assert np.isclose(lhs, sum(_dot(yi, b[0]) for yi, b in zip(y, cb)), rtol=1e-5, atol=1e-5)
    assert np.isclose(lhs, sum(_dot(o[1], b[1]) for o, b in zip(outs, cb)), rtol=1e-5, atol=1e-5)
    # without y: same grad_y, no weight gradient
    cb0 = ref.combine_bwd(hs, gout, None, weighted=True)
    for a, b in zip(cb0, cb):
        assert b[1] is not None and a[1] is None
        assert np.allclose(a[0], b[0])
    # unweighted combine_bwd is dispatch
    cu = ref.combine_bwd(hs, gout, weighted=False)
    outs_g = ref.dispatch(hs, gout, w)
    for a, o in zip(cu, outs_g):
        assert np.array_equal(a[0], o[0])
    # round trip: combine(dispatch(x)) unweighted == x * (number of kept slots of each token)
    rt = ref.combine(hs, [o[0].astype(np.float64) for o in ref.dispatch(hs, [xi.astype(np.float64) for xi in x])],
                     weighted=False)
    for s in range(R):
        n = (idx[s] >= 0).sum(axis=1, keepdims=True)
        assert np.allclose(rt[s], x[s] * n)


def test_reference_combine_rank_order_and_rounding(rng):
    # bf16: each rank rounds its partial once, the owner sums partials in ascending rank order in fp64
    from ml_dtypes import bfloat16

    R, E, K = 2, 4, 4
    idx = [np.array([[0, 1, 2, 3]], np.int32), np.zeros((0, K), np.int32)]
    hs = ref.prepare(idx, E)
    x = [np.ones((1, 8), bfloat16), np.zeros((0, 8), bfloat16)]
    outs = ref.dispatch(hs, x, [np.ones((1, K), np.float32), np.zeros((0, K), np.float32)])
    y = [np.full(o[0].shape, 1 / 3, bfloat16) for o in outs]
    out = ref.combine(hs, y, weighted=False)[0]
    part = (np.float64(np.full(1, 1 / 3, bfloat16)[0]) * 2)
    want = np.float64(np.array([part], bfloat16)[0]) * 2
    assert np.all(out.astype(np.float64) == np.float64(np.array([want], bfloat16)[0]))


def test_reference_t0_everywhere():
    idx = [np.zeros((0, 2), np.int32)] * 2
    hs = ref.prepare(idx, 4)
    outs = ref.dispatch(hs, [np.zeros((0, 3), np.float32)] * 2)
    assert all(o[0].shape == (0, 3) for o in outs)
    assert all(c.shape == (0, 3) for c in ref.combine(hs, [o[0] for o in outs], weighted=False))


def test_reference_capacity_overflow_flagged(rng):
    R, E, K = 2, 4, 2
    idx = [make_routing(rng, 8, E, K, "one"), make_routing(rng, 8, E, K, "one")]
    # every token to expert 0 on rank 0: 16 slots arrive there
    ok = ref.prepare(idx, E, pair_capacity=8, capacity=16)
    assert not any(h["overflow"] for h in ok)
    over = ref.prepare(idx, E, pair_capacity=8, capacity=10)
    assert over[0]["overflow"] and over[0]["expert_overflow"] and not over[1]["overflow"]
    assert over[0]["plan"]["counts"].sum() == 10  # the first 10 slots in expert-major order are kept
    pair = ref.prepare(idx, E, pair_capacity=5, capacity=100)
    assert pair[0]["pair_overflow"] and pair[1]["pair_overflow"]  # both ends of the (1 -> 0) pair know
    assert pair[0]["recv_counts"][1] == 8 and (pair[0]["recv_src"] == 1).sum() == 5
    # dropped rows contribute nothing and get zero gradients
    x = [rng.standard_normal((8, 3)) for _ in range(R)]
    outs = ref.dispatch(pair, x)
    back = ref.combine(pair, [o[0] for o in outs], weighted=False)
    assert np.allclose(back[1][:5], x[1][:5]) and not back[1][5:].any()


def _fp8_inputs(rng, Ts, H, dtype):
    """Per-rank tokens whose rows span very different magnitudes (tiny, unit, large; one all-zero token)."""
    x = []
    for T in Ts:
        a = rng.standard_normal((T, H)) * rng.choice([1e-30, 1e-3, 1.0, 300.0], size=(T, 1))
        if T:
            a[T // 2] = 0.0
        x.append(a.astype(np.float32).astype(dtype))
    return x


@pytest.mark.parametrize("R,E,K,Ts,kind", CASES)
@pytest.mark.parametrize("mode", ["exact", "capacity"])
def test_reference_dispatch_fp8_brute_force(rng, R, E, K, Ts, kind, mode):
    # every expert-major row holds its token's e4m3 codes and scales (quantize_fp8's, bit for bit); rows
    # holding no slot are zero in both; the received weights are those of the unquantized dispatch
    from ml_dtypes import bfloat16

    from moe_rt.reference import fp8 as fref

    H = 300  # three scale blocks, the last one of 44 channels
    idx, _, w = _case(rng, R, E, K, Ts, kind)
    x = _fp8_inputs(rng, Ts, H, bfloat16)
    P = max(Ts) or 1
    kw = {} if mode == "exact" else {"pair_capacity": P, "capacity": R * P * min(K, E // R)}
    hs = ref.prepare(idx, E, align_size=4, **kw)
    qs = [fref.quantize_fp8(xi) for xi in x]
    outs = ref.dispatch_fp8(hs, [q for q, _ in qs], [s for _, s in qs], w)
    plain = ref.dispatch(hs, x, w)
    for d, (h, (rq, rs, rw, tpe), p) in enumerate(zip(hs, outs, plain)):
        assert rq.dtype == qs[0][0].dtype and rs.dtype == np.float32 and rs.shape == (h["num_rows"], 3)
        assert np.array_equal(rw, p[1]) and np.array_equal(tpe, p[2])
        src = h["plan"]["src_slot"]
        for n in range(h["num_rows"]):
            if src[n] < 0:
                assert not rq[n].view(np.uint8).any() and not rs[n].any()
                continue
            r = int(src[n]) // K
            s_, t = int(h["recv_src"][r]), int(h["recv_tok"][r])
            assert np.array_equal(rq[n].view(np.uint8), qs[s_][0][t].view(np.uint8))
            assert np.array_equal(rs[n], qs[s_][1][t])
        # dequantized rows are the tokens within e4m3's precision (3 mantissa bits) of their block's amax
        y = fref.dequantize_fp8(rq, rs, np.float32)
        xs = p[0].astype(np.float32)
        amax = np.repeat(np.maximum.reduceat(np.abs(xs), [0, 128, 256], axis=1), 128, axis=1)[:, :H] \
            if xs.size else xs
        assert np.all(np.abs(y - xs) <= amax * 2.0 ** -4 + 1e-38)


def test_reference_rejects_bad_ids():
    with pytest.raises(ValueError, match="expert ids"):
        ref.prepare([np.array([[0, 4]], np.int32)], 4)
    with pytest.raises(ValueError, match="expert ids"):
        ref.prepare([np.array([[0, -2]], np.int32)], 4)
    with pytest.raises(ValueError, match="same K"):
        ref.prepare([np.zeros((1, 2), np.int32), np.zeros((1, 3), np.int32)], 4)
    with pytest.raises(ValueError, match="divisible"):
        ref.prepare([np.zeros((1, 2), np.int32)] * 3, 4)


# -- EpGroup on the CPU (1 rank) ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("align", [1, 8])
def test_group_cpu_matches_reference(rng, mode, align):
    E, K, T, H = 8, 3, 11, 16
    g = EpGroup(None, E, H, 16, mode=mode, align_size=align)
    idx = make_routing(rng, T, E, K, "holes")
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    h = g.prepare(idx)
    rx, rw, tpe = g.dispatch(h, x, w)
    kw = {} if mode == "exact" else {"pair_capacity": 16, "capacity": 16 * min(K, E)}
    hs = ref.prepare([idx], E, align_size=align, **kw)
    want = ref.dispatch(hs, [x], [w])[0]
    assert np.array_equal(rx, want[0]) and np.array_equal(rw, want[1]) and np.array_equal(tpe, want[2])
    y = rng.standard_normal(rx.shape).astype(np.float32)
    assert np.array_equal(g.combine(h, y), ref.combine(hs, [y])[0])
    assert np.array_equal(g.combine(h, y, weighted=False), ref.combine(hs, [y], weighted=False)[0])
    gx, gw = g.dispatch_bwd(h, y, rw)
    r = ref.dispatch_bwd(hs, [y], [rw])[0]
    assert np.array_equal(gx, r[0]) and np.array_equal(gw, r[1])
    gy, grw = g.combine_bwd(h, x, y)
    r = ref.combine_bwd(hs, [x], [y])[0]
    assert np.array_equal(gy, r[0]) and np.array_equal(grw, r[1])
    assert not h.overflow()
    g.check_overflow(h)


@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("dtype,H,align", [("bfloat16", 300, 1), ("float32", 100, 8), ("float16", 256, 4)])
def test_group_cpu_fp8_dispatch(rng, mode, dtype, H, align):
    # fp8=True: quantize_fp8 then the reference dispatch of the codes and of the scales, bit for bit; a
    # pre-quantized pair (float8_e4m3fn or uint8) gives the same bits in its own dtype; dequantize=True is
    # dequantize_fp8 of those rows; combine and the backwards afterwards are those after a dispatch of x
    import ml_dtypes

    from moe_rt.reference import fp8 as fref

    dt = np.dtype(getattr(ml_dtypes, dtype) if dtype == "bfloat16" else dtype)
    E, K, T = 8, 3, 13
    g = EpGroup(None, E, H, 16, mode=mode, align_size=align)
    idx = make_routing(rng, T, E, K, "holes")
    x = _fp8_inputs(rng, [T], H, dt)[0]
    w = rng.random((T, K)).astype(np.float32)
    h = g.prepare(idx)
    kw = {} if mode == "exact" else {"pair_capacity": 16, "capacity": 16 * min(K, E)}
    hs = ref.prepare([idx], E, align_size=align, **kw)
    q, s = fref.quantize_fp8(x)
    wq = ref.dispatch(hs, [q], [w])[0]
    ws = ref.dispatch(hs, [s])[0][0]
    wx = ref.dispatch(hs, [x], [w])[0]
    rq, rs, rw, tpe = g.dispatch(h, x, w, fp8=True)
    assert rq.dtype == ml_dtypes.float8_e4m3fn and rs.dtype == np.float32
    assert np.array_equal(rq.view(np.uint8), wq[0].view(np.uint8)) and np.array_equal(rs, ws)
    assert np.array_equal(rw, wq[1]) and np.array_equal(tpe, wq[2])
    for pair in ((q, s), (q.view(np.uint8), s), [q, s]):
        pq, ps, pw, ptpe = g.dispatch(h, pair, w, fp8=True)
        assert pq.dtype == pair[0].dtype
        assert np.array_equal(pq.view(np.uint8), wq[0].view(np.uint8)) and np.array_equal(ps, ws)
        assert np.array_equal(pw, wq[1]) and np.array_equal(ptpe, wq[2])
    dq, dw, dtpe = g.dispatch(h, x, w, fp8=True, dequantize=True)
    assert dq.dtype == dt and np.array_equal(dq, fref.dequantize_fp8(wq[0], ws, dt))
    assert np.array_equal(dw, wq[1]) and np.array_equal(dtpe, wq[2])
    # a pair dequantizes to the group's dtype (bfloat16 without one), which then holds for the handle
    hp = g.prepare(idx)
    pd, _, _ = g.dispatch(hp, (q, s), fp8=True, dequantize=True)
    assert pd.dtype == ml_dtypes.bfloat16
    assert np.array_equal(pd, fref.dequantize_fp8(wq[0], ws, ml_dtypes.bfloat16))
    # the gradient path after an FP8 dispatch is the one after a dispatch of x (handle weights and dtype)
    g.dispatch(h, x, w, fp8=True)
    y = rng.standard_normal(rq.shape).astype(np.float32).astype(dt)
    gw = rng.standard_normal(rw.shape).astype(np.float32)
    after_fp8 = (g.combine(h, y), *g.dispatch_bwd(h, y, gw), *g.combine_bwd(h, x, y))
    with pytest.raises(TypeError, match="grad_recv_x: dtype"):
        g.dispatch_bwd(h, y.astype(np.float32 if dt != np.float32 else np.float16))
    rx, _, _ = g.dispatch(h, x, w)
    assert np.array_equal(rx, wx[0])
    after_x = (g.combine(h, y), *g.dispatch_bwd(h, y, gw), *g.combine_bwd(h, x, y))
    for a, b in zip(after_fp8, after_x):
        assert np.array_equal(a, b)
    assert np.array_equal(after_fp8[1], ref.dispatch_bwd(hs, [y], [gw])[0][0])
    # a group with a fixed dtype: a pair dequantizes to it
    g16 = EpGroup(None, E, H, 16, mode=mode, align_size=align, dtype=np.float16)
    h16 = g16.prepare(idx)
    assert g16.dispatch(h16, (q, s), fp8=True, dequantize=True)[0].dtype == np.float16


def test_group_cpu_fp8_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    import ml_dtypes

    from moe_rt.reference import fp8 as fref

    E, K, T, H = 4, 2, 5, 130
    g = EpGroup(None, E, H, 8)
    idx = make_routing(rng, T, E, K)
    h = g.prepare(torch.tensor(idx))
    x = torch.randn(T, H, dtype=torch.bfloat16)
    rq, rs, rw, tpe = g.dispatch(h, x, torch.rand(T, K), fp8=True)
    assert rq.dtype == torch.float8_e4m3fn and rs.dtype == torch.float32 and rw.dtype == torch.float32
    assert isinstance(tpe, torch.Tensor) and rq.shape == (T * K, H) and rs.shape == (T * K, 2)
    q, s = fref.quantize_fp8(x.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    want = ref.dispatch(ref.prepare([idx], E), [q])[0][0]
    assert np.array_equal(rq.view(torch.uint8).numpy(), want.view(np.uint8))
    pq, ps, _, _ = g.dispatch(h, (torch.from_numpy(q.view(np.uint8)), torch.from_numpy(s)), fp8=True)
    assert pq.dtype == torch.uint8 and np.array_equal(pq.numpy(), want.view(np.uint8))
    y, _, _ = g.dispatch(h, x, fp8=True, dequantize=True)
    assert y.dtype == torch.bfloat16


def test_group_fp8_bad_inputs(rng):
    import ml_dtypes

    from moe_rt.reference import fp8 as fref

    E, K, T, H = 4, 2, 6, 260
    g = EpGroup(None, E, H, 8)
    h = g.prepare(make_routing(rng, T, E, K))
    x = rng.standard_normal((T, H)).astype(np.float32)
    q, s = fref.quantize_fp8(x)
    with pytest.raises(TypeError, match="fp8=True"):
        g.dispatch(h, (q, s))
    with pytest.raises(TypeError, match="x: expected an array"):
        g.dispatch(h, (q, s, s), fp8=True)
    with pytest.raises(ValueError, match="dequantize"):
        g.dispatch(h, x, dequantize=True)
    with pytest.raises(TypeError, match="fp8"):
        g.dispatch(h, x, fp8=1)
    with pytest.raises(TypeError, match="dequantize"):
        g.dispatch(h, x, fp8=True, dequantize="yes")
    with pytest.raises(TypeError, match="x_fp8: expected float8_e4m3fn"):
        g.dispatch(h, (q.view(ml_dtypes.float8_e5m2), s), fp8=True)
    with pytest.raises(TypeError, match="x_fp8: expected float8_e4m3fn"):
        g.dispatch(h, (x.astype(np.float16), s), fp8=True)
    with pytest.raises(TypeError, match="x_fp8"):
        g.dispatch(h, (q.view(np.int8), s), fp8=True)
    with pytest.raises(ValueError, match="x_fp8: expected shape"):
        g.dispatch(h, (q[:, :-1], s), fp8=True)  # H not the group's hidden size
    with pytest.raises(ValueError, match="x_fp8: expected shape"):
        g.dispatch(h, (q[:-1], s[:-1]), fp8=True)  # T not the handle's
    with pytest.raises(ValueError, match="x_fp8: expected a 2-D"):
        g.dispatch(h, (q.reshape(-1), s), fp8=True)
    with pytest.raises(TypeError, match="scales: dtype"):
        g.dispatch(h, (q, s.astype(np.float16)), fp8=True)
    with pytest.raises(TypeError, match="scales: dtype"):
        g.dispatch(h, (q, s.view(np.uint8)[:, :3]), fp8=True)
    with pytest.raises(ValueError, match=r"scales: expected shape \[T, ceil\(H/128\)\] = \(6, 3\)"):
        g.dispatch(h, (q, np.ones((T, 2), np.float32)), fp8=True)
    with pytest.raises(ValueError, match="scales: expected shape"):
        g.dispatch(h, (q, s[:-1]), fp8=True)
    with pytest.raises(ValueError, match="scales: expected a 2-D"):
        g.dispatch(h, (q, s.reshape(-1)), fp8=True)
    with pytest.raises(ValueError, match="x: expected shape"):
        g.dispatch(h, x[:, :-1], fp8=True)
    with pytest.raises(TypeError, match="x: dtype"):
        g.dispatch(h, q, fp8=True)  # FP8 codes alone: the scales are needed too
    with pytest.raises(ValueError, match="topk_weights"):
        g.dispatch(h, x, np.ones((T, 3), np.float32), fp8=True)
    # the checks are kept per signature: after good calls, bad inputs of another signature are still refused
    w = np.ones((T, K), np.float32)
    g.dispatch(h, x, w, fp8=True)
    g.dispatch(h, (q, s), w, fp8=True)
    with pytest.raises(ValueError, match="topk_weights"):
        g.dispatch(h, x, np.ones((T, 3), np.float32), fp8=True)
    with pytest.raises(TypeError, match="topk_weights"):
        g.dispatch(h, (q, s), w.astype(np.int32), fp8=True)
    with pytest.raises(ValueError, match="x: expected shape"):
        g.dispatch(h, x[:, :-1], fp8=True)
    with pytest.raises(ValueError, match="scales: expected shape"):
        g.dispatch(h, (q, s[:-1]), w, fp8=True)
    g16 = EpGroup(None, E, H, 8, dtype=np.float16)
    h16 = g16.prepare(make_routing(rng, T, E, K))
    with pytest.raises(TypeError, match="float16"):
        g16.dispatch(h16, x, fp8=True)


@pytest.mark.parametrize("mode", ["exact", "capacity"])
def test_group_dispatch_zero_empty_slots_cpu(rng, mode):
    """zero_empty_slots: keyword-only, a bool (TypeError naming it otherwise, before anything runs); the default
    is True and gives today's bits (the reference's zero rows); on the CPU path False gives the same bits too
    (the NumPy reference writes zeros either way, which "unspecified" allows); FP8 and dequantized likewise."""
    from moe_rt.reference import fp8 as fref

    E, K, T, H = 8, 3, 13, 136
    g = EpGroup(None, E, H, 16, mode=mode, align_size=4)
    idx = make_routing(rng, T, E, K, "holes")
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    h = g.prepare(idx)
    for bad in (1, 0, None, "no", np.array([True])):
        with pytest.raises(TypeError, match="zero_empty_slots: expected a bool"):
            g.dispatch(h, x, w, zero_empty_slots=bad)
        with pytest.raises(TypeError, match="zero_empty_slots: expected a bool"):
            g.dispatch(h, x, w, fp8=True, zero_empty_slots=bad)
    with pytest.raises(TypeError):
        g.dispatch(h, x, w, False, True)  # keyword-only
    kw = {} if mode == "exact" else {"pair_capacity": 16, "capacity": 16 * min(K, E)}
    hs = ref.prepare([idx], E, align_size=4, **kw)
    want = ref.dispatch(hs, [x], [w])[0]
    empty = hs[0]["plan"]["src_slot"] < 0
    assert empty.any()  # padding rows (and the capacity tail) exist
    for z in ({}, {"zero_empty_slots": True}, {"zero_empty_slots": np.bool_(True)}, {"zero_empty_slots": False}):
        rx, rw, tpe = g.dispatch(h, x, w, **z)
        assert np.array_equal(rx, want[0]) and np.array_equal(rw, want[1]) and np.array_equal(tpe, want[2]), z
        assert not rx[empty].any() and not rw[empty].any()
    q, s = fref.quantize_fp8(x)
    rq, rs, rw8, _ = ref.dispatch_fp8(hs, [q], [s], [w])[0]
    for zero in (True, False):
        gq, gs, gw, _ = g.dispatch(h, x, w, fp8=True, zero_empty_slots=zero)
        assert np.array_equal(gq.view(np.uint8), rq.view(np.uint8)) and np.array_equal(gs, rs)
        assert np.array_equal(gw, rw8)
        gy, _, _ = g.dispatch(h, x, w, fp8=True, dequantize=True, zero_empty_slots=zero)
        assert np.array_equal(gy, fref.dequantize_fp8(rq, rs, np.float32))


def test_group_cpu_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    g = EpGroup(None, 4, 8, 8)
    idx = torch.tensor(make_routing(rng, 5, 4, 2))
    h = g.prepare(idx)
    x = torch.randn(5, 8)
    rx, rw, tpe = g.dispatch(h, x, torch.rand(5, 2))
    assert isinstance(rx, torch.Tensor) and rx.shape == (10, 8)
    out = g.combine(h, rx, weighted=False)
    assert torch.allclose(out, 2 * x)


def test_group_cpu_overflow(rng):
    g = EpGroup(None, 4, 4, 8, mode="capacity", capacity=3)
    h = g.prepare(make_routing(rng, 8, 4, 1, "one"))
    assert h.overflow()
    with pytest.raises(RuntimeError, match="overflow"):
        g.check_overflow(h)
    rx, _, tpe = g.dispatch(h, np.ones((8, 4), np.float32))
    assert tpe.tolist() == [3, 0, 0, 0] and rx.shape == (3, 4)


class _FakeComm:
    rank, size, device, closed = 0, 2, 0, False

    def all_gather(self, *a):
        raise AssertionError("must not be called")

    send = recv = group_start = group_end = all_gather


def test_group_validation(rng):
    with pytest.raises(ValueError, match="num_experts"):
        EpGroup(_FakeComm(), 5, 4, 4)
    with pytest.raises(TypeError, match="comm"):
        EpGroup(object(), 4, 4, 4)
    with pytest.raises(ValueError, match="mode"):
        EpGroup(None, 4, 4, 4, mode="fast")
    with pytest.raises(ValueError, match="capacity"):
        EpGroup(None, 4, 4, 4, capacity=3)
    with pytest.raises(TypeError, match="hidden"):
        EpGroup(None, 4, 4.0, 4)
    with pytest.raises(ValueError, match="timeout"):
        EpGroup(None, 4, 4, 4, timeout=0)
    with pytest.raises(TypeError, match="dtype"):
        EpGroup(None, 4, 4, 4, dtype=np.int32)
    # a multi-rank group cannot run on CPU arrays
    with pytest.raises(TypeError, match="CUDA arrays"):
        EpGroup(_FakeComm(), 4, 4, 4, transport="nccl").prepare(np.zeros((2, 1), np.int32))

    g = EpGroup(None, 4, 8, 6)
    with pytest.raises(ValueError, match="expert ids"):
        g.prepare(np.array([[0, 4]], np.int32))
    with pytest.raises(TypeError, match="topk_idx"):
        g.prepare(np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        g.prepare(np.zeros((7, 2), np.int32))
    with pytest.raises(ValueError, match="topk_idx"):
        g.prepare(np.zeros(4, np.int32))
    h = g.prepare(np.array([[0, 1], [2, -1], [3, 3]], np.int32))
    with pytest.raises(ValueError, match="K must be 2"):
        g.prepare(np.zeros((2, 3), np.int32))
    x = rng.standard_normal((3, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="x: expected shape"):
        g.dispatch(h, x[:2])
    with pytest.raises(ValueError, match="x: expected shape"):
        g.dispatch(h, np.zeros((3, 7), np.float32))
    with pytest.raises(TypeError, match="x: dtype"):
        g.dispatch(h, x.astype(np.int32))
    with pytest.raises(ValueError, match="topk_weights"):
        g.dispatch(h, x, np.ones((3, 3), np.float32))
    with pytest.raises(TypeError, match="handle"):
        g.dispatch("handle", x)
    rx, rw, _ = g.dispatch(h, x)
    with pytest.raises(ValueError, match="weighted=True"):
        g.combine(h, rx)
    with pytest.raises(TypeError, match="y: dtype"):  # dtype fixed by dispatch
        g.combine(h, rx.astype(np.float16), weighted=False)
    with pytest.raises(ValueError, match="y: expected shape"):
        g.combine(h, rx[:-1], weighted=False)
    with pytest.raises(TypeError, match="weighted"):
        g.combine(h, rx, weighted=1)
    with pytest.raises(ValueError, match="grad_recv_w"):
        g.dispatch_bwd(h, rx, np.zeros(rx.shape[0] + 1, np.float32))
    with pytest.raises(ValueError, match="grad_out"):
        g.combine_bwd(h, rx, weighted=False)
    # a handle of another group, a closed handle, a closed group
    other = EpGroup(None, 4, 8, 6)
    with pytest.raises(ValueError, match="belongs to EP group"):
        other.dispatch(h, x)
    h.close()
    with pytest.raises(ValueError, match="closed"):
        g.dispatch(h, x)
    with pytest.raises(ValueError, match="closed"):
        h.view("meta")
    g.close()
    with pytest.raises(ValueError, match="closed"):
        g.prepare(np.zeros((1, 2), np.int32))
    # a fixed group dtype
    g16 = EpGroup(None, 4, 8, 6, dtype=np.float16)
    h = g16.prepare(np.zeros((3, 2), np.int32))
    with pytest.raises(TypeError, match="float16"):
        g16.dispatch(h, x)


def test_chunks_keyword_and_env(monkeypatch):
    monkeypatch.delenv("MOE_RT_EP_CHUNKS", raising=False)
    assert EpGroup(None, 4, 4, 4).chunks == 2
    assert EpGroup(None, 4, 4, 4, chunks=4).chunks == 4
    monkeypatch.setenv("MOE_RT_EP_CHUNKS", "3")
    assert EpGroup(None, 4, 4, 4).chunks == 3
    assert EpGroup(None, 4, 4, 4, chunks=2).chunks == 2  # the keyword wins
    assert "chunks=3" in repr(EpGroup(None, 4, 4, 4))
    for bad in ("0", "65", "many"):
        monkeypatch.setenv("MOE_RT_EP_CHUNKS", bad)
        with pytest.raises(ValueError, match="MOE_RT_EP_CHUNKS"):
            EpGroup(None, 4, 4, 4)
    monkeypatch.delenv("MOE_RT_EP_CHUNKS")
    with pytest.raises(ValueError, match="chunks"):
        EpGroup(None, 4, 4, 4, chunks=0)
    with pytest.raises(TypeError, match="chunks"):
        EpGroup(None, 4, 4, 4, chunks=2.0)


def test_overlap_keyword_env_and_auto_choice(monkeypatch):
    from moe_rt import _ep_nccl

    monkeypatch.delenv("MOE_RT_EP_OVERLAP", raising=False)
    assert EpGroup(None, 4, 4, 4).overlap is None  # auto
    for v, want in (("auto", None), ("1", True), ("0", False), ("", None)):
        monkeypatch.setenv("MOE_RT_EP_OVERLAP", v)
        assert EpGroup(None, 4, 4, 4).overlap is want
    monkeypatch.setenv("MOE_RT_EP_OVERLAP", "0")
    assert EpGroup(None, 4, 4, 4, overlap=True).overlap is True  # the keyword wins
    assert "overlap=False" in repr(EpGroup(None, 4, 4, 4))
    monkeypatch.setenv("MOE_RT_EP_OVERLAP", "yes")
    with pytest.raises(ValueError, match="MOE_RT_EP_OVERLAP"):
        EpGroup(None, 4, 4, 4)
    monkeypatch.delenv("MOE_RT_EP_OVERLAP")
    with pytest.raises(TypeError, match="overlap"):
        EpGroup(None, 4, 4, 4, overlap=1)

    # auto: overlapped from _OVERLAP_MIN_BYTES of rows sent by this rank; never on one rank
    monkeypatch.setattr(_ep_nccl, "_OVERLAP_MIN_BYTES", 1000)
    fake = type("C", (_FakeComm,), {"rank": 0, "size": 2})()
    sent = {"rows": 0}
    for overlap, rows, itemsize, want in ((None, 124, 2, False), (None, 125, 2, True), (None, 62, 4, False),
                                          (None, 32, 8, True), (False, 10**6, 2, False), (True, 1, 2, True)):
        g = EpGroup(fake, 4, 4, 8, overlap=overlap, transport="nccl")
        monkeypatch.setattr(g._transport, "_send_rows", lambda h: sent["rows"])
        sent["rows"] = rows
        assert g._transport._overlapped(None, 4 * itemsize) is want, (overlap, rows, itemsize)  # rows of H=4
    assert EpGroup(None, 4, 4, 8, overlap=True)._transport._overlapped(None, 8) is False


@pytest.mark.parametrize("min_bytes", [0, 1000])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("R", [2, 3, 5])
def test_chunk_plan_parts_match_between_ranks(rng, monkeypatch, R, chunks, min_bytes):
    # Part i of a pair's rows must travel in group i on both ranks of the pair, with the same rows; the
    # parts must tile each peer's range exactly once.
    from moe_rt import _ep_nccl

    monkeypatch.setattr(_ep_nccl, "_MIN_CHUNK_BYTES", min_bytes)
    rb = 64
    counts = rng.integers(0, 40, size=(R, R))  # counts[s, d]: rows s sends to d
    counts[0, 1] = 0
    groups = []
    for r in range(R):
        fake = type("C", (_FakeComm,), {"rank": r, "size": R})()
        groups.append(EpGroup(fake, 2 * R, 4, 64, chunks=chunks, transport="nccl"))
    plans = []
    for r, g in enumerate(groups):
        sc = [int(counts[r, d]) for d in range(R)]
        rc = [int(counts[s, r]) for s in range(R)]
        so = list(np.cumsum([0] + [0 if d == r else sc[d] for d in range(R)])[:R])
        ro = list(np.cumsum([0] + rc)[:R])
        plan = g._transport._chunk_plan(sc, so, rc, ro, rb)
        plans.append(plan)
        for p in range(R):
            if p == r:
                assert all(part[0][p] == 0 and part[2][p] == 0 for part in plan)
                continue
            for cnt, off, a, b in ((sc, so, 0, 1), (rc, ro, 2, 3)):
                rows = [(part[b][p], part[b][p] + part[a][p]) for part in plan if part[a][p]]
                assert sum(hi - lo for lo, hi in rows) == cnt[p]
                assert all(rows[i][1] == rows[i + 1][0] for i in range(len(rows) - 1))
                if rows:
                    assert rows[0][0] == off[p]
                n_parts = len(rows)
                assert n_parts <= max(1, chunks)
                if min_bytes == 0 and cnt[p]:
                    assert n_parts == min(chunks, cnt[p])
    for s in range(R):
        for d in range(R):
            if s == d:
                continue
            n = max(len(plans[s]), len(plans[d]))
            for i in range(n):
                sent = plans[s][i][0][d] if i < len(plans[s]) else 0
                got = plans[d][i][2][s] if i < len(plans[d]) else 0
                assert sent == got, (s, d, i)


def test_env_timeout(monkeypatch):
    monkeypatch.setenv("MOE_RT_EP_TIMEOUT", "7.5")
    assert EpGroup(None, 4, 4, 4).timeout == 7.5
    monkeypatch.setenv("MOE_RT_EP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MOE_RT_EP_TIMEOUT"):
        EpGroup(None, 4, 4, 4)


# -- transports ----------------------------------------------------------------------------------------------

def test_transport_keyword_env_and_one_rank(monkeypatch):
    monkeypatch.delenv("MOE_RT_EP_TRANSPORT", raising=False)
    for t in (None, "auto", "direct", "nccl"):
        g = EpGroup(None, 4, 4, 4, transport=t)  # one rank: no transport, the local path unchanged
        assert g.transport is None and "transport=None" in repr(g)
    with pytest.raises(ValueError, match="transport"):
        EpGroup(None, 4, 4, 4, transport="ipc")
    with pytest.raises(TypeError, match="transport"):
        EpGroup(None, 4, 4, 4, transport=1)
    monkeypatch.setenv("MOE_RT_EP_TRANSPORT", "fast")
    with pytest.raises(ValueError, match="MOE_RT_EP_TRANSPORT"):
        EpGroup(None, 4, 4, 4)
    # the env var is read (and a forced nccl never probes: the fake comm's all_gather raises)
    monkeypatch.setenv("MOE_RT_EP_TRANSPORT", "nccl")
    g = EpGroup(_FakeComm(), 4, 4, 4)
    assert g.transport == "nccl" and "transport='nccl'" in repr(g)
    monkeypatch.setenv("MOE_RT_EP_TRANSPORT", "direct")
    assert EpGroup(_FakeComm(), 4, 4, 4, transport="nccl").transport == "nccl"  # the keyword wins


def test_transports_share_one_interface():
    # EpGroup calls only these on its transport: a transport is one class with the same signatures
    import inspect

    from moe_rt import _ep_direct, _ep_mixed, _ep_nccl

    for name in ("forward", "reduce", "failed_op", "close"):
        sigs = [inspect.signature(getattr(cls, name)) for cls in (_ep_nccl.NcclTransport, _ep_direct.DirectTransport,
                                                                  _ep_mixed.MixedTransport)]
        assert sigs[0] == sigs[1] == sigs[2], (name, sigs)
    # prepare's NCCL exchange of segments: the mixed transport offers the NCCL transport's
    assert inspect.signature(_ep_mixed.MixedTransport.exchange_box) == inspect.signature(
        _ep_nccl.NcclTransport.exchange_box)
    g = EpGroup(_FakeComm(), 4, 4, 8, transport="nccl", chunks=3, overlap=False)
    t = g._transport
    assert isinstance(t, _ep_nccl.NcclTransport) and (t.chunks, t.overlap, t.hidden) == (3, False, 4)
    assert t.failed_op() is None
    one = EpGroup(None, 4, 4, 8)  # one rank: the NCCL path without an exchange, no public transport
    assert one.transport is None and isinstance(one._transport, _ep_nccl.NcclTransport)
    g.close()
    assert g._transport is None


def test_transport_choice_from_the_probe(monkeypatch):
    from moe_rt import _ep_direct, _ep_mixed

    monkeypatch.delenv("MOE_RT_EP_TRANSPORT", raising=False)
    monkeypatch.delenv("MOE_RT_EP_LOCAL_SIZE", raising=False)
    made, closed, probed = [], [], []

    class FakeDirect:
        def __init__(self, comm, device, pair_rows, timeout, wait, op_wait=None, node=None):
            made.append((device, pair_rows, timeout, node))
            self.op_wait = op_wait
            self.lo, self.hi = node

        def close(self):
            closed.append(1)

        def failed_op(self):
            return None

    def probe(verdict):
        def f(comm, device, wait, local_size):
            probed.append(local_size)
            return verdict
        return f

    monkeypatch.setattr(_ep_direct, "DirectTransport", FakeDirect)
    monkeypatch.setattr(_ep_direct, "probe_nodes", probe((2, False, "rank 1's GPU cannot access rank 0's GPU")))
    assert EpGroup(_FakeComm(), 4, 4, 4).transport == "nccl"  # auto falls back
    assert EpGroup(_FakeComm(), 4, 4, 4, transport="auto").transport == "nccl"
    with pytest.raises(ValueError, match="cannot access"):
        EpGroup(_FakeComm(), 4, 4, 4, transport="direct")
    assert not made and probed == [None] * 3
    # two hosts of one rank each: auto picks the mixed path, direct refuses
    monkeypatch.setattr(_ep_direct, "probe_nodes", probe((1, True, "")))
    with pytest.raises(ValueError, match="different nodes"):
        EpGroup(_FakeComm(), 4, 4, 4, transport="direct")
    g1 = EpGroup(_FakeComm(), 4, 4, 4)
    assert g1.transport == "mixed" and g1.local_size == 1 and "local_size=1" in repr(g1)
    assert isinstance(g1._transport, _ep_mixed.MixedTransport) and made[-1][3] == (0, 1)
    assert (g1._transport.lo, g1._transport.hi) == (0, 1) and g1._transport.nccl.chunks == g1.chunks
    # one node: direct, over every rank
    monkeypatch.setattr(_ep_direct, "probe_nodes", probe((2, True, "")))
    g = EpGroup(_FakeComm(), 4, 4, 8, transport="auto", timeout=7)
    assert g.transport == "direct" and "transport='direct'" in repr(g) and g.local_size == 2
    assert made[-1] == (0, 8, 7.0, (0, 2))  # exact mode: pair rows = max_tokens_per_rank
    g2 = EpGroup(_FakeComm(), 4, 4, 8, mode="capacity", pair_capacity=3, transport="direct")
    assert g2.transport == "direct" and made[-1][1] == 3
    assert isinstance(g2._transport, FakeDirect)  # the NCCL path (and its overlap) never runs on it
    assert g2._transport.op_wait is not None
    n_made = len(made)
    with pytest.raises(ValueError, match="local_size=1 makes 2 nodes"):  # refused before any probe
        EpGroup(_FakeComm(), 4, 4, 8, transport="direct", local_size=1)
    assert len(made) == n_made and probed[-1] is None
    g.close()
    g.close()
    assert closed == [1]
    g1.close()
    assert closed == [1, 1]  # the mixed transport closes its direct part
    with pytest.raises(ValueError, match="closed"):
        g.synchronize()


class _Runtime:
    """A stand-in for cupy.cuda.runtime in the probe's decision (no GPU)."""

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self, visible, peer_ok):
        self.visible, self.peer_ok = visible, peer_ok  # bus id -> local ordinal; (a, b) -> bool

    def deviceGetPCIBusId(self, dev):
        return {v: k for k, v in self.visible.items()}[dev]

    def deviceGetByPCIBusId(self, bus):
        if bus not in self.visible:
            raise self.CUDARuntimeError("cudaErrorInvalidDevice")
        return self.visible[bus]

    def deviceCanAccessPeer(self, a, b):
        return int(self.peer_ok.get((a, b), True))


@pytest.mark.parametrize("case", ["ok", "other_node", "no_peer", "not_visible", "same_gpu"])
def test_probe_decision(monkeypatch, case):
    from moe_rt import _ep_direct

    R = 3
    buses = ["0000:1a:00.0", "0000:3c:00.0", "0001:9d:00.0"]
    hosts = [11, 11, 22 if case == "other_node" else 11]
    ident = np.array([[hosts[r], _ep_direct._bus_code(buses[r]), r] for r in range(R)], np.int64)
    if case == "same_gpu":
        ident[2, 1] = ident[1, 1]
    visible = {b: i for i, b in enumerate(buses)}
    if case == "not_visible":
        del visible[buses[2]]
    rt = _Runtime(visible, {(0, 1): case != "no_peer", (1, 0): case != "no_peer"})
    # each rank's own verdict (as ranks 0 and 1 see the machine)
    reasons = [_ep_direct.local_reason(ident, me, me, rt) for me in range(2)]
    want = {"ok": "", "other_node": "different nodes", "no_peer": "cannot access", "not_visible": "not visible",
            "same_gpu": "same GPU"}[case]
    if case == "ok":
        assert reasons == ["", ""]
    else:
        assert any(want in r for r in reasons), reasons
    # the group decision: every rank's verdict all-gathered; not ok anywhere -> not ok everywhere
    verdicts = np.array([[0 if r else 1] for r in reasons] + [[1]], np.int64)
    for me in range(2):
        n = {"calls": 0}

        def gather(comm, values, stream, wait):
            n["calls"] += 1
            if n["calls"] == 1:
                assert list(values)[:2] == [hosts[me], int(ident[me, 1])]
                return ident
            assert list(values) == [0 if reasons[me] else 1]
            return verdicts

        monkeypatch.setattr(_ep_direct, "all_gather_int64", gather)
        monkeypatch.setattr(_ep_direct, "host_identity", lambda: hosts[me])
        comm = type("C", (), {"rank": me, "size": R})()
        rt.deviceGetPCIBusId = lambda dev: buses[dev] if case != "same_gpu" or dev != 2 else buses[1]
        ok, reason = _ep_direct._decide(comm, me, None, None, rt)
        assert n["calls"] == 2
        assert ok == (case == "ok") and (ok or reason), (case, me, ok, reason)


def test_bus_id_round_trip():
    from moe_rt import _ep_direct

    for b in ("0000:1a:00.0", "0001:9d:1f.7", "00000000:3C:00.0"):
        code = _ep_direct._bus_code(b)
        back = _ep_direct._bus_string(code)
        assert _ep_direct._bus_code(back) == code
    with pytest.raises(RuntimeError, match="PCI bus id"):
        _ep_direct._bus_code("nonsense")
    assert isinstance(_ep_direct.host_identity(), int) and 0 <= _ep_direct.host_identity() < 2**63
    assert _ep_direct.host_identity() == _ep_direct.host_identity()


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_direct_kernels_compile(arch):
    from moe_rt import _ep_direct, _jit

    names = [n for f, n in _jit.registered() if f == _ep_direct._FILE and n in _ep_direct._names]
    assert len(names) == len(_ep_direct._names) and any("ep_direct_barrier" in n for n in names)
    image, lowered = _jit.compile_offline("ep.cu", arch, names)
    assert set(lowered) == set(names)
    # the NCCL path's owner sum shares the direct path's body: both still compile
    _jit.compile_offline("ep.cu", arch, ["ep_owner_sum<__nv_bfloat16, true>", "ep_owner_sum<float, false>"])


# -- the handle layout ---------------------------------------------------------------------------------------

HEADER = ROOT / "include" / "moe_rt" / "moe_rt.h"


def test_header_regions_match_python():
    text = HEADER.read_text()
    block = re.search(r"enum moe_rt_ep_region \{(.*?)\};", text, re.S)
    assert block, "enum moe_rt_ep_region"
    enum = re.findall(r"MOE_RT_EP_([A-Z_]+) = (\d+)", block.group(1))
    names = [n.lower() for n, _ in enum if n != "NUM_REGIONS"]
    assert names == [r[0] for r in _handle.REGIONS]
    assert [int(i) for _, i in enum[:len(names)]] == list(range(len(names)))
    for name, off, _ in _handle.META_FIELDS:
        m = re.search(rf"#define MOE_RT_EP_META_{name.upper()}\(R\) (.+)", text)
        assert m, name
        for R in (1, 2, 3, 8):
            c_expr = m.group(1).replace("(R)", "R")
            assert eval(c_expr, {"R": R}) == eval(off, {"R": R}), name
    assert f"#define MOE_RT_EP_HANDLE_ALIGN {_handle.ALIGN}" in text


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_header_layout_compiles_and_agrees(tmp_path):
    sizes = [(1, 4, 5, 2, 5, 5, 10), (2, 3, 7, 3, 7, 11, 29), (4, 32, 4096, 8, 4096, 16384, 131072),
             (8, 1, 1, 1, 1, 0, 0)]
    src = tmp_path / "t.c"
    body = "\n".join(
        f"  {{ moe_rt_ep_handle_desc d = {{{R}, {L}, {Tm}, {K}, {P}, {rows}, {N}}}; moe_rt_ep_handle_layout(&d);"
        f" for (int i = 0; i < MOE_RT_EP_NUM_REGIONS; ++i) printf(\"%llu \", (unsigned long long)d.offset[i]);"
        f" printf(\"%llu\\n\", (unsigned long long)d.total_bytes); }}"
        for R, L, Tm, K, P, rows, N in sizes)
    src.write_text(f'#include <stdio.h>\n#include "moe_rt/moe_rt.h"\nint main(void) {{\n{body}\n  return 0;\n}}\n')
    cc = shutil.which("cc") or shutil.which("gcc")
    exe = tmp_path / "t"
    subprocess.run([cc, "-std=c99", "-Wall", "-Werror", f"-I{ROOT / 'include'}", str(src), "-o", str(exe)],
                   check=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    for line, (R, L, Tm, K, P, rows, N) in zip(lines, sizes):
        lay, total = _handle.layout(R, L, Tm, K, P, rows, N)
        want = [lay[name][0] for name, _, _ in _handle.REGIONS] + [total]
        assert [int(v) for v in line.split()] == want


def test_handle_regions_and_dlpack(rng):
    E, K, T = 8, 2, 6
    g = EpGroup(None, E, 4, 8, align_size=2)
    idx = make_routing(rng, T, E, K, "holes")
    h = g.prepare(idx)
    assert isinstance(h, Handle) and h.mode == "exact" and h.group_id == g.id
    d = ref.prepare([idx], E, align_size=2)[0]
    lay, total = _handle.layout(1, E, 8, K, 8, d["num_recv_rows"], d["num_rows"])
    assert h.layout == lay and h.nbytes == total
    assert all(off % _handle.ALIGN == 0 for off, _, _ in lay.values())
    assert np.array_equal(h.view("seg_start"), d["plan"]["seg_start"])
    assert np.array_equal(h.view("tokens_per_expert"), d["tokens_per_local_expert"])
    assert np.array_equal(h.view("dst_row").reshape(-1, K), d["plan"]["dst_row"])
    assert np.array_equal(h.view("recv_local").reshape(-1, K), d["recv_local"])
    meta = h.view("meta")
    assert meta[_handle.meta_index("num_tokens", 1)] == T
    assert meta[_handle.meta_index("total_slots", 1)] == (idx >= 0).sum()
    routing = h.view("routing")
    assert np.array_equal(routing[:T * K], idx.ravel()) and routing[-1] == T
    u8 = np.from_dlpack(h)
    assert u8.dtype == np.uint8 and u8.shape == (total,)
    assert "Handle(" in repr(h)
    h.close()
    h.close()
    with pytest.raises(ValueError):
        np.from_dlpack(h)


# -- launcher and bootstrap (CPU, 2 processes) -------------------------------------------------------------------

def _launch(tmp_path, script_text, n=2, extra=(), timeout=60):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(script_text))
    return subprocess.run([sys.executable, str(LAUNCH), "-n", str(n), "--cpu", *extra, str(script)],
                          capture_output=True, text=True, timeout=timeout)


def test_launcher_env_and_prefix(tmp_path):
    r = _launch(tmp_path, """
        import os
        print("env", os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"],
              os.environ["NCCL_NVLS_ENABLE"], bool(os.environ["MOE_RT_UID_FILE"]))
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank 0] env 0 2 0 0 True" in r.stdout and "[rank 1] env 1 2 1 0 True" in r.stdout


def test_launcher_failure_stops_the_others(tmp_path):
    import time

    t0 = time.monotonic()
    r = _launch(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(60)
    """, extra=("--grace", "2"))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "rank 1 exited with status 3" in r.stdout
    assert time.monotonic() - t0 < 30


def test_launcher_timeout(tmp_path):
    r = _launch(tmp_path, "import time; time.sleep(60)\n", extra=("--timeout", "1", "--grace", "1"))
    assert r.returncode == 124


def test_shared_file_bootstrap_two_processes(tmp_path):
    r = _launch(tmp_path, """
        import os
        from moe_rt.bootstrap import share_bytes_via_file
        rank = int(os.environ["RANK"])
        data = share_bytes_via_file(os.environ["MOE_RT_UID_FILE"], rank, lambda: os.urandom(128), timeout=30)
        assert len(data) == 128
        print("uid", data.hex())
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    uids = re.findall(r"\[rank \d\] uid ([0-9a-f]+)", r.stdout)
    assert len(uids) == 2 and uids[0] == uids[1]


def test_shared_file_bootstrap_timeout(tmp_path):
    from moe_rt.bootstrap import share_bytes_via_file

    with pytest.raises(TimeoutError, match="did not appear"):
        share_bytes_via_file(tmp_path / "never", 1, timeout=0.2)


def test_bootstrap_store_and_env(monkeypatch):
    from moe_rt import bootstrap

    class Store(dict):
        def set(self, k, v):
            self[k] = v

        def get(self, k):
            return self[k]

    monkeypatch.setattr(bootstrap, "get_unique_id", lambda: b"\x07" * 128)
    st = Store()
    assert bootstrap.unique_id_from_store(st, 0) == b"\x07" * 128
    assert bootstrap.unique_id_from_store(st, 1) == b"\x07" * 128
    st["bad"] = b"x"
    with pytest.raises(RuntimeError, match="128-byte"):
        bootstrap.unique_id_from_store(st, 1, key="bad")
    monkeypatch.delenv("NCCL_COMM_ID", raising=False)
    with pytest.raises(RuntimeError, match="NCCL_COMM_ID"):
        bootstrap.unique_id_from_env()
    with pytest.raises(ValueError, match="method"):
        bootstrap.init_communicator(0, 1, 0, method="carrier-pigeon")


@pytest.mark.parametrize("given, env, match", [
    ({}, {}, "rank: not given and the environment variable RANK is not set"),
    ({"rank": 0}, {}, "world_size: not given and the environment variable WORLD_SIZE is not set"),
    ({}, {"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer, got 'x'"),
    ({}, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": ""}, "LOCAL_RANK must be an integer"),
])
def test_init_communicator_names_the_missing_environment(monkeypatch, given, env, match):
    from moe_rt import bootstrap

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match) as e:
        bootstrap.init_communicator(**given, method="file")
    if not env:
        assert "RANK and WORLD_SIZE" in str(e.value)


# -- multi-GPU: tests/ep_worker.py on 2 GPUs ------------------------------------------------------------------

def _gpu_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def _run_worker(*args, timeout=240, n=2):
    if n > _gpu_count():
        pytest.skip(f"needs {n} CUDA GPUs")
    env = dict(os.environ, MOE_RT_EP_TIMEOUT="60")
    r = subprocess.run([sys.executable, str(LAUNCH), "-n", str(n), "--timeout", str(timeout),
                        str(ROOT / "tests" / "ep_worker.py"), *args], capture_output=True, text=True, env=env,
                       timeout=timeout + 60)
    print(r.stdout[-20000:])
    print(r.stderr[-5000:])
    return r


@pytest.mark.multi_gpu
def test_multi_gpu_ep_against_reference():
    r = _run_worker("correctness")
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout


@pytest.mark.multi_gpu
def test_multi_gpu_graph_determinism_memory():
    r = _run_worker("graph")
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout


@pytest.mark.multi_gpu
def test_multi_gpu_dead_peer_times_out():
    r = _run_worker("dead_peer", timeout=120)
    assert r.returncode == 0 and "[rank 0] DEAD PEER OK" in r.stdout


# The direct peer-memory transport (moe_rt/_ep_direct.py) against the NCCL one, at every R up to the GPU
# count (small shapes: a few seconds each), and the mixed group (transport="auto", local_size=n: peer memory
# within nodes of n ranks, NCCL between them; moe_rt/_ep_mixed.py) at n in {1, R/2, R}.

@pytest.mark.multi_gpu
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("what", ["transports", "graph_transports", "mixed", "graph_mixed"])
def test_multi_gpu_transports(what, n):
    # transports: direct against the NumPy reference, NCCL (serial and overlapped) bitwise against direct:
    # dispatch, combine, dispatch_bwd, combine_bwd in exact and capacity modes, and (with torch) the direct
    # transport's ops on torch tensors (the lean path) bitwise equal to them on CuPy arrays; graph_transports: capacity
    # mode captured in a CUDA graph per transport, replayed with new routing, bitwise across transports;
    # mixed / graph_mixed: the same per node size (and an FP8 dispatch with torch), against the reference and
    # bitwise against direct and NCCL
    r = _run_worker(what, n=n, timeout=300 if "mixed" in what else 240 if what == "transports" else 180)
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout


@pytest.mark.multi_gpu
@pytest.mark.parametrize("n", [2, 4])
def test_multi_gpu_zero_rows(n):
    # capacity mode on the direct transport and the mixed groups (nodes smaller than R): each dispatch and
    # combine_bwd into a pool poisoned with NaN bits, compared with the reference row by row (the rows holding no
    # slot zero); zero_empty_slots=False leaves them unwritten; every later op as in the other cases
    r = _run_worker("zero_rows", n=n, timeout=300)
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout and "zero_rows: " in r.stdout


@pytest.mark.multi_gpu
@pytest.mark.parametrize("n", [2, 4])
def test_multi_gpu_fp8_dispatch(n):
    # EpGroup.dispatch(fp8=True) in exact and capacity modes on the direct and NCCL transports: bitwise equal
    # to quantize_fp8 then the reference dispatch (torch bf16/fp16/fp32 in, float8_e4m3fn out; a CuPy uint8
    # pair; dequantize=True), combine and dispatch_bwd afterwards as after a dispatch of x, direct == NCCL;
    # H = 77 too (the packed rows' byte-wide sink pieces); the FP8 sinks compile on first use (a longer timeout)
    pytest.importorskip("torch")
    r = _run_worker("fp8", n=n, timeout=360)
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout


@pytest.mark.multi_gpu
@pytest.mark.parametrize("n", [2, 4])
def test_multi_gpu_direct_lifecycle(n):
    # graph replay, 1000 eager iterations with flat memory, and teardown order on the direct transport
    r = _run_worker("direct_lifecycle", n=n, timeout=300)
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout


@pytest.mark.multi_gpu
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("what", ["dead_peer_direct", "dead_peer_mixed"])
def test_multi_gpu_direct_dead_peer_times_out(what, n):
    # dead_peer_mixed: nodes of R/2 ranks (1 at R = 2); rank 1 skips a dispatch: its node peers see the direct
    # barrier's error naming the op, the other nodes' ranks their NCCL exchange time out
    r = _run_worker(what, n=n, timeout=120)
    assert r.returncode == 0 and "[rank 0] DEAD PEER OK" in r.stdout


# -- prepare's launches on CUDA, traced on the CPU --------------------------------------------------------------

class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class _Arr:
    """A stand-in device array: an address and a size (prepare only takes pointers of its buffers)."""
    _next = [1 << 20]

    def __init__(self, n, dtype, ptr=None):
        self.dtype, self.size = np.dtype(dtype), int(n)
        if ptr is None:
            ptr = _Arr._next[0]
            _Arr._next[0] += (self.size * self.dtype.itemsize + 255) // 256 * 256 + 256
        self.data = _Ptr(ptr)

    def __getitem__(self, sl):
        start = sl.start or 0
        stop = self.size if sl.stop is None else sl.stop
        return _Arr(stop - start, self.dtype, self.data.ptr + start * self.dtype.itemsize)

    def __setitem__(self, sl, other):
        _Trace.events.append(("copy", sl.stop - (sl.start or 0)))

    def view(self, dtype):
        return _Arr(self.size * self.dtype.itemsize // np.dtype(dtype).itemsize, dtype, self.data.ptr)


class _Trace:
    events = []

    @staticmethod
    def empty(n, dtype):
        a = _Arr(n, dtype)
        _Trace.events.append(("alloc", int(n), a.data.ptr))
        return a

    @staticmethod
    def zeros(n, dtype):
        a = _Arr(n, dtype)
        _Trace.events.append(("zeros", int(n), a.data.ptr))
        return a


class _Kernel:
    def __init__(self, name):
        self.name = self.kernel = name


class _RecComm(_FakeComm):
    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def all_gather(self, send, recv, count, dtype, stream):
        _Trace.events.append(("all_gather", count, dtype))

    def group_start(self):
        _Trace.events.append(("group_start",))

    def group_end(self):
        _Trace.events.append(("group_end",))

    def send(self, ptr, count, dtype, peer, stream):
        _Trace.events.append(("send", peer, count, ptr))

    def recv(self, ptr, count, dtype, peer, stream):
        _Trace.events.append(("recv", peer, count, ptr))


class _Box:
    table, local = _Arr(2, np.int64), 1 << 40


class _RecDirect:
    state = _Arr(2, np.uint32)
    bar = _Box
    timeout_ns, _err_ptr = 10**9, 128

    def prepare_box(self, K, half, stream, wait):
        return _Box

    def barrier(self, stream, op):
        _Trace.events.append(("ep_direct_barrier", op))

    def failed_op(self):
        return None


def _stand_in_prepare(monkeypatch, record, sms, resident):
    """Kernels, devices and the scratch stood in for prepare on the CPU: the core's launches (a planning context
    of ``sms`` SMs on which ``resident`` blocks of 256 threads are resident at once, a multiple of ``sms``) go to
    ``record(name, grid, block, args)`` after checking that each passes as many arguments as its kernel takes."""
    from moe_rt import _arrays, _core, _ep_rows, _errors, _jit

    ctx = _core.planning(sm_count=sms, assumed_regs=65536 // (256 * max(1, resident // sms)) // 8 * 8)
    real = _core.ep_prepare

    def ep_prepare(c, step, desc, bufs, stream):
        real(ctx, step, desc, bufs, stream)
        for i, launch in enumerate(ctx.last_plan()):
            name, args = launch[1].split("<")[0], ctx.last_plan_args(i)
            assert len(args) == len(_kernel_params("ep.cu" if name.startswith("ep_") else "permutation.cu", name))
            record(name, launch[2], launch[3], args)

    monkeypatch.setattr(_core, "device", lambda dev: ctx)
    monkeypatch.setattr(_core, "ep_prepare", ep_prepare)
    monkeypatch.setattr(_jit, "device_properties", lambda dev: {"sm_count": sms})
    monkeypatch.setattr(_errors, "word", lambda dev: 64)
    monkeypatch.setattr(_arrays, "contiguous", lambda xp, a: a)
    monkeypatch.setattr(_ep_rows, "copy_bytes", lambda dst, src, n, stream: _Trace.events.append(("copy", n, dst, src)))


def _traced_group(R, me, E, Tmax, mode, transport):
    """A group of rank ``me`` of ``R`` on the given transport (kernels, NCCL and the direct transport's shared
    buffers stood in for: _Trace records what prepare issues)."""
    comm = None if R == 1 else _RecComm(me, R)
    g = EpGroup(comm, E, 8, Tmax, mode=mode, transport="nccl")
    # grid_sync's words: a plain device allocation, zeroed once per group and device
    g._grid_sync_words = lambda dev, stream: (_Trace.events.append(("memset", 8)), 1 << 36)[1]
    if transport == "direct":
        g.transport, g._transport = "direct", _RecDirect()
    if transport == "mixed":  # prepare's segments through NCCL with every peer, as on the NCCL transport
        from moe_rt import _ep_mixed

        node = type("D", (), {"lo": me - 1, "hi": me + 1})()
        g.transport, g._transport = "mixed", _ep_mixed.MixedTransport(node, g._transport)
    return g


def _kernel_params(file, name):
    """``[(C type or "ptr", name)]`` of kernel ``name``'s parameters in kernels/``file``."""
    m = re.search(rf"\b{name}\(([^)]*)\)\s*\{{", (ROOT / "kernels" / file).read_text())
    assert m, name
    words = [p.replace("*", " * ").split() for p in m.group(1).split(",") if p.strip()]
    return [("ptr" if "*" in w else w[-2], w[-1]) for w in words]


@pytest.mark.parametrize("transport,R", [("nccl", 1), ("nccl", 3), ("direct", 3), ("mixed", 3)])
@pytest.mark.parametrize("mode", ["capacity", "exact"])
@pytest.mark.parametrize("fused", [True, False])
def test_prepare_launch_trace(monkeypatch, transport, R, mode, fused):
    """The launches, collectives and allocations of prepare on CUDA, per transport and mode (drivers, kernels
    and memory stood in for): no all-gather of the routing table, only counts and the sent rows; one kernel
    for the received side (ep_prepare_plan) unless its shared memory would not fit (then ep_prepare_recv and
    the permutation plan's kernels); each launch passes as many arguments as its kernel takes."""
    _Trace.events = []
    _stand_in_prepare(monkeypatch, lambda name, grid, block, args: _Trace.events.append((name, grid)), 4, 8)
    # ep_prepare_plan's shared memory (4*(2R + 1 + R*(L + 2) + 4L + 1) bytes) fits 40 KiB with 4 experts a rank,
    # not with 3000
    E, K, Tmax, T, me = (4 if fused else 3000) * R, 2, 16, 11, R - 1
    g = _traced_group(R, me, E, Tmax, mode, transport)
    rows, slots = 7 * R, 9 * R
    host = np.zeros(5 * R + 10, np.int32)
    host[_handle.meta_index("recv_rows", R)] = rows
    host[_handle.meta_index("total_slots", R)] = slots
    host[_handle.meta_index("send_counts", R):][:R] = np.arange(R) + 3
    host[_handle.meta_index("recv_counts", R):][:R] = np.arange(R) + 5
    monkeypatch.setattr(g, "_read_meta", lambda meta, s, dev: (_Trace.events.append(("host read",)), host)[1])
    call = type("Call", (), {"xp": _Trace, "stream": type("S", (), {"ptr": 9})(), "device_id": 0})()
    idx = _Arr(T * K, np.int32)
    for _ in range(2):  # the second call runs from the cached set-up
        _Trace.events = []
        h = g._prepare_cuda(call, idx, T, K)
    names = [e[0] for e in _Trace.events if e[0] not in ("alloc", "copy")]
    P, L = (Tmax if mode == "exact" else g.pair_capacity), E // R
    CW, W = L + 2, 2 * K + 1
    group = ["group_start"] + ["send", "recv"] * (R - 1) + ["group_end"] if transport != "direct" and R > 1 else []
    exchange = ["ep_direct_barrier"] if transport == "direct" else group
    recv = ["ep_prepare_plan"] if fused else ["ep_prepare_recv", "plan_count", "plan_scan", "plan_assign"]
    if mode == "capacity" and transport == "direct" and fused:
        want = ["ep_prepare_direct"]  # send side, barrier and received side in one kernel
    elif mode == "capacity":
        want = ["ep_prepare_send"] + exchange + recv
    else:
        want = ["ep_prepare_send"] + exchange + ["ep_plan_meta", "host read"] + group + recv
    assert names == want
    assert "all_gather" not in names  # nothing is all-gathered: every rank gets its own part only
    sent = [e[2] for e in _Trace.events if e[0] == "send"]
    got = [e[2] for e in _Trace.events if e[0] == "recv"]
    peers = [p for p in range(R) if p != me]
    if group and mode == "capacity":  # each destination's whole segment: counts, then P rows
        assert sent == got == [CW + P * W] * (R - 1)
    elif group:  # the counts, then the kept rows the host read gave
        assert sent == [CW] * (R - 1) + [min(3 + p, P) * W for p in peers]
        assert got == [CW] * (R - 1) + [min(5 + p, P) * W for p in peers]
    allocs = [e for e in _Trace.events if e[0] == "alloc"]
    if group:  # segment p of the outbox goes to peer p; peer p's arrives in segment p of the inbox
        inbox = allocs[1][2]
        outbox = inbox + 4 * R * (CW + P * W)
        offs = [0] * (R - 1) + ([CW] * (R - 1) if mode == "exact" else [])
        seg = CW + P * W
        assert [e[3] for e in _Trace.events if e[0] == "send"] == [
            outbox + 4 * (p * seg + o) for p, o in zip(peers * 2, offs)]
        assert [e[3] for e in _Trace.events if e[0] == "recv"] == [
            inbox + 4 * (p * seg + o) for p, o in zip(peers * 2, offs)]
    # the handle and the scratch (exact: a second handle sized from the host read, and the plan's scratch)
    assert len(allocs) == (2 if mode == "capacity" else 3 if fused else 4)
    # exact mode: the leading regions (routing, send lists, counts) into the handle sized from the host read: one
    # memcpy from the first allocation
    assert [e for e in _Trace.events if e[0] == "copy"] == ([] if mode == "capacity" else
                                                            [("copy", h.layout["recv_local"][0], allocs[2][2],
                                                              allocs[0][2])])
    assert h.sizes["rows"] == (R * P if mode == "capacity" else rows)
    assert h.layout["routing"][2] == Tmax * K + 1  # this rank's routing only


# The most kernel launches and NCCL groups one capacity-mode prepare issues, per transport (the send side, the
# exchange and the received side fused as far as the transport allows: on the direct transport one kernel).
_PREPARE_LAUNCH_BUDGET = {"direct": (1, 0), "nccl": (2, 1), "mixed": (2, 1)}


@pytest.mark.parametrize("transport", ["direct", "nccl", "mixed"])
@pytest.mark.parametrize("R", [2, 4, 8])
@pytest.mark.parametrize("T", [0, 100, 4096])
def test_prepare_capacity_launch_budget(monkeypatch, transport, R, T):
    """A capacity-mode prepare (after its first call, which makes the set-up) issues at most the budgeted
    kernel launches and NCCL groups, no memset and no host read, the same at every R (nothing per peer but
    the NCCL group's send/recv pairs); its send side's grid covers its chunks within one resident wave."""
    from moe_rt import _jit

    launches = []
    resident = 2 * 132
    _stand_in_prepare(monkeypatch, lambda name, grid, block, args: launches.append((name, grid, block)), 132,
                      resident)
    monkeypatch.setattr(_jit, "launch", lambda *a, **k: launches.append(("launch",)))
    E, K, Tmax, me = 256, 8, 4096, R - 1
    g = _traced_group(R, me, E, Tmax, "capacity", transport)
    monkeypatch.setattr(g, "_read_meta", lambda *a: pytest.fail("capacity mode read the device"))
    call = type("Call", (), {"xp": _Trace, "stream": type("S", (), {"ptr": 9})(), "device_id": 0})()
    idx = _Arr(max(T, 1) * K, np.int32)
    g._prepare_cuda(call, idx, T, K)
    for _ in range(2):
        _Trace.events, launches[:] = [], []
        g._prepare_cuda(call, idx, T, K)
        kernels, groups = _PREPARE_LAUNCH_BUDGET[transport]
        assert len(launches) <= kernels, launches
        assert [e[0] for e in _Trace.events].count("group_start") <= groups
        assert not [e for e in _Trace.events if e[0] in ("memset", "zeros", "all_gather", "ep_direct_barrier")]
        c = next(iter(g._prep_cfgs.values()))
        assert c.B * c.TC >= T and c.B <= 64 and c.TC % 32 == 0
        grid = launches[0][1]
        assert grid <= resident and grid >= min(resident, R * c.B)
        assert launches[0][2] == 256


@pytest.mark.parametrize("transport", ["direct", "nccl"])
def test_prepare_grid_sync_words_per_stream(monkeypatch, transport):
    """prepare's send side synchronizes its blocks through two words of device memory per group and stream,
    made (and zeroed) once: later calls on a stream reuse its words, another stream gets its own, another
    group its own."""
    sent = []
    _stand_in_prepare(monkeypatch, lambda name, grid, block, args: sent.append((name, args)), 132, 264)
    made = []

    def words(g):
        def make(dev, stream):
            made.append((id(g), stream.ptr))
            return 4096 * len(made)
        return make

    gs = [_traced_group(2, 1, 16, 64, "capacity", transport) for _ in range(2)]
    for g in gs:
        g._grid_sync_words = words(g)
    streams = [type("S", (), {"ptr": p})() for p in (9, 10)]
    idx = _Arr(40 * 2, np.int32)
    for g, stream in [(gs[0], streams[0]), (gs[0], streams[0]), (gs[0], streams[1]), (gs[1], streams[0]),
                      (gs[0], streams[1])]:
        call = type("Call", (), {"xp": _Trace, "stream": stream, "device_id": 0})()
        g._prepare_cuda(call, idx, 40, 2)
    # the send side's last argument (ep_prepare_send); ep_prepare_direct's 22nd (after the send side's scratch)
    name, at = ("ep_prepare_send", -1) if transport == "nccl" else ("ep_prepare_direct", 21)
    assert [a[at] for n, a in sent if n == name] == [4096, 4096, 8192, 12288, 8192]
    assert made == [(id(gs[0]), 9), (id(gs[0]), 10), (id(gs[1]), 9)]


# -- the eager ops' host side on the direct transport, the device stood in for (tools/profile_ep_host.py) ---------

class _EpHostTrace:
    """The device stood in for (tools/profile_ep_host.py's EpStandIns, undone after the test), each launch
    recorded with its arguments by parameter name after checking their count and types, each memcpy too;
    ``take()``: the events, allocations and CuPy kernels since the last take."""

    def __init__(self, monkeypatch):
        import importlib.util

        pytest.importorskip("cupy")
        from moe_rt import _ep_rows

        spec = importlib.util.spec_from_file_location("profile_ep_host", ROOT / "tools" / "profile_ep_host.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        monkeypatch.setattr(_ep_rows, "_launches", {})  # set-ups made with the stand-in kernels stay here
        self.st = mod.EpStandIns(monkeypatch.setattr, resident=8, sm_count=4)
        self.st.on_launch = self._launch
        self.st.on_memcpy = lambda dst, src, n, kind, stream: self.events.append(("memcpy", dst, src, n))
        self.events = []

    def _launch(self, fn, grid, block, args):
        name = fn.name.split("<")[0]
        params = _kernel_params("ep.cu", name)
        assert len(args) == len(params), name
        for (ctype, pname), a in zip(params, args):  # each argument of the type its parameter takes
            want = {"int": np.int32, "i64": np.int64}.get(ctype)
            if type(a) is int:  # the core's launches (a planning context): int parameters get 32-bit values
                ok = {"int": -2**31 <= a < 2**31, "i64": -2**63 <= a < 2**63}.get(ctype, a >= 0)
                assert ok, (name, pname, a)
                continue
            assert (type(a) is want) if want else hasattr(a, "data"), (name, pname, a)
        self.events.append((name, {pname: (int(a) if type(a) is int or isinstance(a, np.generic) else a.data.ptr)
                                   for (_, pname), a in zip(params, args)}))

    def take(self):
        ev, self.events = self.events, []
        allocs, self.st.allocs = self.st.allocs, 0
        ck, self.st.cupy_kernels = self.st.cupy_kernels, 0
        assert ck == 0  # no CuPy kernel on the eager path
        return ev, allocs


def _ptr(a):
    return a.data.ptr


@pytest.mark.parametrize("mode", ["capacity", "exact"])
@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("T", [13, 0])
def test_direct_host_path_launches_and_arguments(monkeypatch, mode, R, T):
    """Pinned: each eager op of an EpGroup on the direct transport (device stood in for) issues exactly these
    launches (and memcpys), with these arguments by parameter name (the handle's regions, the transport's
    tables, the op's arrays and constants of the types the kernels take), and this many allocations, from its
    second call on the same at R=2 and R=4 and without a kernel lookup; no CuPy kernel anywhere."""
    import ml_dtypes

    from moe_rt import _ep_direct

    from moe_rt import _ep_rows

    tr = _EpHostTrace(monkeypatch)
    st, OP = tr.st, _ep_direct.OP_CODES

    def python_side_copy(*a):
        raise AssertionError("the direct transport's dispatch copies tokens_per_expert in its core call")

    monkeypatch.setattr(_ep_rows, "tokens_per_expert", python_side_copy)  # the one Python-side copy (EpGroup has none)
    me, E, H, Tmax, K = R - 1, 4 * R, 40, 16, 3
    L, bf = E // R, np.dtype(ml_dtypes.bfloat16)
    g = st.ep_group(R, me, E, H, Tmax, K, mode, bf)
    d = g._transport
    x, idx, w = st.dev((T, H), bf), st.dev((T, K), np.int32), st.dev((T, K), np.float32)
    gout = st.dev((T, H), bf)
    rows_st, w_st = d._stages[("rows", 2 * H)], d._stages[("weights", K)]
    P = d.P
    consts = dict(state=_ptr(d.state), err_word=96, timeout_ns=10**9, R=R, me=me, P=P, K=K, lo=0, hi=R)

    def barrier(op):
        return ("ep_direct_barrier", dict(peer_bar=_ptr(d.bar.table), R=R, me=me, state=_ptr(d.state),
                                          timeout_ns=10**9, err_word=96, op=OP[op], lo=0, hi=R))

    for n in range(2):
        st.lookups = 0
        h = g.prepare(idx)
        ev, allocs = tr.take()
        a = {k: h.buffer.data.ptr + v[0] for k, v in h.layout.items()}
        if mode == "capacity":  # one kernel: send side, barrier, received side
            assert [e[0] for e in ev] == ["ep_prepare_direct"] and allocs == 2
            args = ev[0][1]
            assert {k: args[k] for k in ("idx", "T", "routing", "send_tok", "send_pos", "meta", "recv_tok",
                                         "recv_local", "dst_row", "src_slot", "seg_start", "expert_counts",
                                         "tokens_per_expert", "state", "peer_box", "peer_bar", "err_word", "op",
                                         "timeout_ns")} == dict(
                idx=idx.ptr, T=T, state=_ptr(d.state), peer_box=_ptr(d._stages[("prepare", K)].table),
                peer_bar=_ptr(d.bar.table), err_word=96, op=OP["prepare"], timeout_ns=10**9,
                **{k: a[k] for k in ("routing", "send_tok", "send_pos", "meta", "recv_tok", "recv_local", "dst_row",
                                     "src_slot", "seg_start", "expert_counts", "tokens_per_expert")})
        else:  # send side, barrier, the counts for the host read, then the received side into the resized handle
            assert [e[0] for e in ev] == ["ep_prepare_send", "ep_direct_barrier", "ep_plan_meta", "memcpy",
                                          "ep_prepare_plan"] and allocs == 3
            assert ev[1] == barrier("prepare")
            assert ev[3][1] == h.buffer.data.ptr and ev[3][3] == h.layout["recv_local"][0]
            assert ev[4][1]["tokens_per_expert"] == a["tokens_per_expert"] and ev[4][1]["rows"] == h.sizes["rows"]
        if n:
            assert st.lookups == 0  # the kernels of a prepare set-up are looked up once

        N, rows = h.sizes["N"], h.sizes["rows"]
        rx, rw, tpe = g.dispatch(h, x, w)
        ev, allocs = tr.take()
        names = [e[0] for e in ev]
        row_map = mode == "exact"  # exact mode: the received rows' stage rows, made once per handle
        # one kernel does it all: the rows, their zeros, recv_wk and the laid-out weights (the zero items write
        # the empty rows' zeros), and tokens_per_expert into a fresh int32 [L] (its block 0)
        assert names == ["ep_direct_barrier", "ep_direct_dispatch"] + ["ep_direct_row_map"] * row_map
        assert allocs == 3 + row_map  # the rows, the weights, tokens_per_expert (and the row map)
        assert ev[0] == barrier("dispatch")
        C = max(1, min(32, P, max(16, -(-P * max(1, R - 1) // (4 * 2 * 132)))))  # rows a chunk flag covers
        assert ev[1][1] == dict(consts, x=x.ptr, w=w.ptr, peer_rows=_ptr(rows_st.table),
                                peer_w=_ptr(w_st.table), peer_flags=_ptr(d.flags.table), send_tok=a["send_tok"],
                                meta=a["meta"], dst_row=a["dst_row"], out=_ptr(rx), out_s=0, fp8_h=0,
                                zero_src=a["src_slot"] if N else 0, zero_n=N, zero_rows=int(N > 0),
                                recv_wk=a["recv_wk"], w_travel=1, out_w=_ptr(rw), tpe_src=a["tokens_per_expert"],
                                tpe_out=_ptr(tpe), L=L, op=OP["dispatch"], C=C, units=2 * H // 16)
        assert tpe.dtype == np.int32 and tpe.shape == (L,)
        assert rx.shape == (N, H) and rw.shape == (N,)

        # zero_empty_slots=False: the same launch, but ep_direct_dispatch zeroes no rows (zero_rows = 0: the
        # rows holding no slot are not written; its zero items still zero their weights); without weights no
        # weights at all (and no zero items)
        rx1, _, tpe1 = g.dispatch(h, x, zero_empty_slots=False)
        ev2, allocs2 = tr.take()
        assert [e[0] for e in ev2] == ["ep_direct_barrier", "ep_direct_dispatch"] and allocs2 == 2
        assert ev2[1][1] == dict(ev[1][1], w=0, out=_ptr(rx1), zero_src=0, zero_n=0, zero_rows=0, recv_wk=0,
                                 w_travel=0, out_w=0, tpe_out=_ptr(tpe1))
        rx2, rw2, tpe2 = g.dispatch(h, x, w, zero_empty_slots=False)
        ev2, allocs2 = tr.take()
        assert [e[0] for e in ev2] == [n_ for n_ in names if n_ != "ep_direct_row_map"] and allocs2 == 3
        assert ev2[1][1] == dict(ev[1][1], out=_ptr(rx2), zero_rows=0, out_w=_ptr(rw2), tpe_out=_ptr(tpe2))

        y = st.dev((N, H), bf)
        out = g.combine(h, y)
        ev, allocs = tr.take()
        assert allocs == 1 and out.shape == (T, H)
        comb = dict(consts, y=y.ptr if N else 0, w=a["recv_wk"], zw=0, peer_rows=_ptr(rows_st.table),
                    peer_w=_ptr(w_st.table), peer_flags=_ptr(d.flags.table), dst_row=a["dst_row"],
                    send_pos=a["send_pos"], routing_me=a["routing"], meta=a["meta"], out=_ptr(out), grad_w=0,
                    op=OP["combine"], L=L, Tmax=Tmax, Tn=T, C=C, H=H)
        assert ev == [barrier("combine"), ("ep_direct_combine", comb)]

        gx, gw = st.dev((N, H), bf), st.dev((N,), np.float32)
        ox, ow = g.dispatch_bwd(h, gx, gw)
        ev, allocs = tr.take()
        # grad_x, grad_w, and on the group's first dispatch_bwd the slots' partials (the transport's scratch)
        assert allocs == 3 - (n > 0) and ox.shape == (T, H) and ow.shape == (T, K)
        assert [e[0] for e in ev] == ["ep_slot_values", "ep_direct_barrier", "ep_direct_combine"]
        zw = ev[0][1]["out"]
        assert ev[0][1] == dict(vals=gw.ptr if N else 0, dst_row=a["dst_row"], out=zw, n=rows * K)
        assert ev[1:] == [barrier("dispatch_bwd"), ("ep_direct_combine", dict(
            comb, y=gx.ptr if N else 0, w=0, zw=zw, out=_ptr(ox), grad_w=_ptr(ow), op=OP["dispatch_bwd"]))]

        gy, none = g.combine_bwd(h, gout)
        ev, allocs = tr.take()
        # grad_y, and on the group's first combine_bwd its weights (the transport's scratch)
        assert none is None and allocs == 2 - (n > 0) and gy.shape == (N, H)
        # the dispatch kernel lays out the dispatch's weights (recv_wk, w_travel = 0) and its sink (RowScale: rows
        # of 16-byte units) weights each row by them as it writes it: no second kernel
        assert [e[0] for e in ev] == ["ep_direct_barrier", "ep_direct_dispatch"]
        assert ev[0] == barrier("combine_bwd")
        pp = ev[1][1]["out_w"]
        assert ev[1][1] == dict(ev[1][1], x=gout.ptr, w=0, out=_ptr(gy), op=OP["combine_bwd"],
                                zero_src=a["src_slot"] if N else 0, zero_n=N, zero_rows=int(N > 0),
                                recv_wk=a["recv_wk"], w_travel=0, tpe_out=0)
        assert pp != 0 or not N
        if n:
            assert st.lookups == 0  # every launch set-up made once


@pytest.mark.parametrize("mode", ["capacity", "exact"])
def test_direct_host_path_stream_by_address(monkeypatch, mode):
    """The eager ops after prepare (direct transport, device stood in for) take the call's stream by its address
    (``Call.stream_ptr``) and never read ``Call.stream``, which in a light torch call makes CuPy's device and
    stream current (entered, then left at the call's exit): host time spent on every call otherwise."""
    import ml_dtypes

    from moe_rt import _arrays

    tr = _EpHostTrace(monkeypatch)
    st = tr.st
    reads = []

    class Counting(_arrays.Call):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            reads.clear()

        @property
        def stream(self):
            reads.append(1)
            return self._s

        @stream.setter
        def stream(self, v):
            self._s = v

    monkeypatch.setattr(_arrays, "Call", Counting)
    R, E, H, Tmax, K, T = 2, 8, 40, 16, 3, 11
    bf = np.dtype(ml_dtypes.bfloat16)
    g = st.ep_group(R, 1, E, H, Tmax, K, mode, bf)
    h = g.prepare(st.dev((T, K), np.int32))
    N = h.sizes["N"]
    x, w = st.dev((T, H), bf), st.dev((T, K), np.float32)
    calls = {"dispatch": lambda: g.dispatch(h, x, w), "combine": lambda: g.combine(h, st.dev((N, H), bf)),
             "dispatch_bwd": lambda: g.dispatch_bwd(h, st.dev((N, H), bf), st.dev((N,), np.float32)),
             "combine_bwd": lambda: g.combine_bwd(h, st.dev((T, H), bf))}
    for op, f in calls.items():
        f()  # the first call makes the stages and scratch (with the stream: a collective)
        f()
        assert reads == [], op
        assert g._last_stream == 7, op  # the stand-in's stream, by address (EpGroup.synchronize takes either)


@pytest.mark.parametrize("mode", ["capacity", "exact"])
def test_direct_host_path_validation(monkeypatch, mode):
    """The CUDA path of each eager op (direct transport, device stood in for) still refuses bad input with the
    TypeError / ValueError naming the argument, before any launch."""
    import ml_dtypes

    tr = _EpHostTrace(monkeypatch)
    st = tr.st
    R, E, H, Tmax, K, T = 2, 8, 40, 16, 3, 11
    bf = np.dtype(ml_dtypes.bfloat16)
    g = st.ep_group(R, 1, E, H, Tmax, K, mode, bf)
    idx = st.dev((T, K), np.int32)
    with pytest.raises(TypeError, match="topk_idx"):
        g.prepare(st.dev((T, K), np.float32))
    with pytest.raises(ValueError, match="topk_idx: T="):
        g.prepare(st.dev((Tmax + 1, K), np.int32))
    h = g.prepare(idx)
    N = h.sizes["N"]
    tr.take()
    x, w = st.dev((T, H), bf), st.dev((T, K), np.float32)
    bad = [(lambda: g.dispatch(h, st.dev((T, H + 1), bf), w), ValueError, "x: expected shape"),
           (lambda: g.dispatch(h, st.dev((T, H), np.float32), w), TypeError, "x: dtype must be bfloat16"),
           (lambda: g.dispatch(h, x, st.dev((T, K + 1), np.float32)), ValueError, "topk_weights"),
           (lambda: g.dispatch(h, x, st.dev((T, K), np.int32)), TypeError, "topk_weights"),
           (lambda: g.dispatch("h", x, w), TypeError, "handle"),
           (lambda: g.combine(h, st.dev((N, H), bf)), ValueError, "weighted=True needs topk_weights"),
           (lambda: g.combine(h, st.dev((N + 1, H), bf), weighted=False), ValueError, "y: expected shape"),
           (lambda: g.combine(h, st.dev((N, H), bf), weighted=1), TypeError, "weighted"),
           (lambda: g.dispatch_bwd(h, st.dev((N, H), bf), st.dev((N + 1,), np.float32)), ValueError, "grad_recv_w"),
           (lambda: g.combine_bwd(h, st.dev((T, H - 1), bf), weighted=False), ValueError, "grad_out: expected"),
           (lambda: g.combine_bwd(h, st.dev((T, H), bf), st.dev((N, H), np.float16), weighted=False), TypeError, "y")]
    for f, exc, match in bad:
        with pytest.raises(exc, match=match):
            f()
        assert tr.take() == ([], 0)  # refused before any launch or allocation
    # the checks passed once per signature are kept (EpGroup._valid): good calls of every op, twice, then the same
    # refusals (the last dispatch without weights, as above)
    for _ in range(2):
        g.dispatch(h, x, w)
        g.combine(h, st.dev((N, H), bf))
        g.dispatch_bwd(h, st.dev((N, H), bf), st.dev((N,), np.float32))
        g.combine_bwd(h, st.dev((T, H), bf), st.dev((N, H), bf), weighted=False)
        g.combine_bwd(h, st.dev((T, H), bf))
        g.dispatch(h, x)
    assert g._valid
    tr.take()
    for f, exc, match in bad:
        with pytest.raises(exc, match=match):
            f()
        assert tr.take() == ([], 0)


def test_profile_ep_host_tool_runs():
    """tools/profile_ep_host.py (the host time of each eager op with the device stood in for) runs without a GPU
    and counts the launches and allocations the tests above pin, the same at R=2 and R=4."""
    pytest.importorskip("cupy")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "profile_ep_host.py"), "--calls", "2"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    # launches, allocations, CuPy kernels, memcpys per call
    want = {"prepare": ("1", "2", "0", "0"), "dispatch": ("2", "3", "0", "0"), "combine": ("2", "1", "0", "0"),
            # combine_bwd: the barrier and the dispatch kernel, whose sink weights the rows (no ep_scale_rows)
            "dispatch_bwd": ("3", "2", "0", "0"), "combine_bwd": ("2", "1", "0", "0"),
            # FP8: the quantize into packed rows, the barrier, the dispatch; the packed rows, tokens_per_expert,
            # codes and scales (or the dequantized rows) and the weights
            "dispatch fp8": ("3", "5", "0", "0"), "dispatch fp8 dequantize": ("3", "4", "0", "0")}
    got = {}
    for line in r.stdout.splitlines()[1:]:
        f = line.split()
        op, (mode, R, us), counts = " ".join(f[:-7]), f[-7:-4], tuple(f[-4:])
        assert float(us) > 0
        got[(op, mode, R)] = counts
    assert len(got) == 8 * 2 * 2
    for op, counts in want.items():
        assert got[(op, "capacity", "2")] == got[(op, "capacity", "4")] == counts, op


@pytest.mark.gpu
@pytest.mark.parametrize("mode,pair", [("capacity", 700), ("capacity", None), ("exact", None)])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_one_gpu_prepare_many_chunks_matches_cpu_handle(rng, mode, pair, id_dtype):
    """prepare's send side over many chunks of tokens (B up to 64 per destination; pair capacity 700 ending
    inside a chunk): the handle holds, region by region, what the CPU path writes (poisoned pool memory
    underneath)."""
    import cupy as cp

    E, K, H, Tmax = 64, 6, 16, 9000
    kw = {} if mode == "exact" else {"pair_capacity": pair}
    g_gpu = EpGroup(None, E, H, Tmax, mode=mode, **kw)
    g_cpu = EpGroup(None, E, H, Tmax, mode=mode, **kw)
    for T in (Tmax, 4097, 700, 129, 31, 0):
        for kind in ("holes", "skewed", "one"):
            idx = make_routing(rng, T, E, K, kind).astype(id_dtype)
            cp.cuda.Device().synchronize()
            poison = cp.full(1 << 22, 0x5A, cp.uint8)
            del poison
            h = g_gpu.prepare(cp.asarray(idx))
            hc = g_cpu.prepare(idx)
            assert h.layout == hc.layout and h.sizes == hc.sizes
            for region in ("meta", "routing", "send_tok", "send_pos", "recv_tok", "recv_local", "dst_row",
                           "src_slot", "seg_start", "expert_counts", "tokens_per_expert"):
                assert np.array_equal(h.view(region).get(), hc.view(region)), (T, kind, region)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,align,pair", [("exact", 1, None), ("exact", 4, None), ("capacity", 1, None),
                                             ("capacity", 8, 5), ("capacity", 1, 3)])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("E", [7, 3001])  # 3001 experts: ep_prepare_recv and the plan kernels (not fused)
def test_one_gpu_prepare_matches_cpu_handle(rng, mode, align, pair, id_dtype, E):
    """A 1-rank group on one GPU: prepare's handle holds, region by region, what the CPU path writes (poisoned
    pool memory underneath), for odd sizes, T = 0 and T = Tmax, dropped pairs and slots; dispatch's rows match."""
    import cupy as cp

    K, H, Tmax = 3, 40, 13
    kw = {} if mode == "exact" else {"pair_capacity": pair, "capacity": 8}
    g_gpu = EpGroup(None, E, H, Tmax, mode=mode, align_size=align, **kw)
    g_cpu = EpGroup(None, E, H, Tmax, mode=mode, align_size=align, **kw)
    for T in (Tmax, 0, 9, 1):
        idx = make_routing(rng, T, E, K, "holes").astype(id_dtype)
        cp.cuda.Device().synchronize()
        poison = cp.full(1 << 20, 0x5A, cp.uint8)  # freed into the pool: later allocations start dirty
        del poison
        h = g_gpu.prepare(cp.asarray(idx))
        hc = g_cpu.prepare(idx)
        assert h.layout == hc.layout and h.sizes == hc.sizes
        for region in ("meta", "routing", "send_tok", "send_pos", "recv_tok", "recv_local", "dst_row", "src_slot",
                       "seg_start", "expert_counts", "tokens_per_expert"):
            assert np.array_equal(h.view(region).get(), hc.view(region)), (T, region)
        x = rng.standard_normal((T, H)).astype(np.float32)
        w = rng.random((T, K)).astype(np.float32)
        rx, rw, tpe = g_gpu.dispatch(h, cp.asarray(x), cp.asarray(w))
        crx, crw, ctpe = g_cpu.dispatch(hc, x, w)
        assert np.array_equal(rx.get(), crx) and np.array_equal(rw.get(), crw) and np.array_equal(tpe.get(), ctpe)


# -- the mixed transport (peer memory within a node, NCCL between nodes): arguments, nodes, traced ops --------

def test_local_size_keyword_env_and_errors(monkeypatch):
    monkeypatch.delenv("MOE_RT_EP_TRANSPORT", raising=False)
    monkeypatch.delenv("MOE_RT_EP_LOCAL_SIZE", raising=False)
    fake4 = type("C", (_FakeComm,), {"rank": 1, "size": 4})
    for bad in (2.0, "2", True, [2]):
        with pytest.raises(TypeError, match="local_size"):
            EpGroup(fake4(), 8, 4, 4, transport="nccl", local_size=bad)
    for bad in (0, -2, 3, 8):
        with pytest.raises(ValueError, match="local_size: must divide the 4 ranks"):
            EpGroup(fake4(), 8, 4, 4, transport="nccl", local_size=bad)
    g = EpGroup(fake4(), 8, 4, 4, transport="nccl", local_size=np.int64(2))  # transport='nccl' never probes
    assert g.local_size == 2 and type(g.local_size) is int and "local_size=2" in repr(g)
    assert EpGroup(fake4(), 8, 4, 4, transport="nccl").local_size is None  # not probed: unknown
    one = EpGroup(None, 4, 4, 4, local_size=1)
    assert one.local_size == 1 and one.transport is None and "local_size=1" in repr(one)
    assert EpGroup(None, 4, 4, 4).local_size == 1
    with pytest.raises(ValueError, match="local_size"):
        EpGroup(None, 4, 4, 4, local_size=2)
    # 'direct' with several nodes: refused at creation, before any collective (the fake comm's all_gather raises)
    with pytest.raises(ValueError, match="transport='direct': local_size=2 makes 2 nodes"):
        EpGroup(fake4(), 8, 4, 4, transport="direct", local_size=2)
    monkeypatch.setenv("MOE_RT_EP_LOCAL_SIZE", "2")
    assert EpGroup(fake4(), 8, 4, 4, transport="nccl").local_size == 2
    assert EpGroup(None, 4, 4, 4).local_size == 1  # the variable is for multi-rank groups
    with pytest.raises(ValueError, match="local_size=2 makes 2 nodes"):
        EpGroup(fake4(), 8, 4, 4, transport="direct")
    assert EpGroup(fake4(), 8, 4, 4, transport="nccl", local_size=4).local_size == 4  # the keyword wins
    for bad in ("two", "0", "-1", "1.5"):
        monkeypatch.setenv("MOE_RT_EP_LOCAL_SIZE", bad)
        with pytest.raises(ValueError, match="MOE_RT_EP_LOCAL_SIZE"):
            EpGroup(fake4(), 8, 4, 4, transport="nccl")
    monkeypatch.setenv("MOE_RT_EP_LOCAL_SIZE", "3")
    with pytest.raises(ValueError, match="local_size: must divide"):
        EpGroup(fake4(), 8, 4, 4, transport="nccl")
    monkeypatch.setenv("MOE_RT_EP_LOCAL_SIZE", "")
    assert EpGroup(fake4(), 8, 4, 4, transport="nccl").local_size is None


def test_node_partition():
    from moe_rt import _ep_direct

    assert _ep_direct.node_size([7, 7, 7, 7]) == 4
    assert _ep_direct.node_size([7, 7, 9, 9]) == 2
    assert _ep_direct.node_size([7, 9, 5, 3]) == 1
    assert _ep_direct.node_size([7, 7, 9, 9, 5, 5]) == 2
    assert _ep_direct.node_size([7, 9, 7, 9]) is None  # a host's ranks not consecutive
    assert _ep_direct.node_size([7, 7, 9, 9, 9, 9]) is None  # unequal nodes
    assert _ep_direct.node_size([7, 7, 7, 9]) is None
    assert _ep_direct.node_size([7, 7, 9, 9, 7, 7]) is None  # one host, two blocks


@pytest.mark.parametrize("case", ["one_node", "two_hosts", "explicit_2", "explicit_1", "no_peer_in_node",
                                  "no_peer_across", "interleaved"])
def test_node_probe_decision(monkeypatch, case):
    """probe_nodes' decision on R = 4 ranks (hosts, PCI bus ids and peer access stood in for): the node size (given
    or derived from the hosts), and peer access checked within each node only."""
    from moe_rt import _ep_direct

    R = 4
    buses = ["0000:1a:00.0", "0000:3c:00.0", "0000:5e:00.0", "0000:7f:00.0"]
    hosts = {"two_hosts": [11, 11, 22, 22], "no_peer_across": [11, 11, 11, 11],
             "interleaved": [11, 22, 11, 22]}.get(case, [11] * R)
    given = {"explicit_2": 2, "explicit_1": 1, "no_peer_across": 2}.get(case)
    ident = np.array([[hosts[r], _ep_direct._bus_code(buses[r]), r % 2 if hosts != [11] * R else r]
                      for r in range(R)], np.int64)
    no_peer = {"no_peer_in_node": {(0, 1), (1, 0)}, "no_peer_across": {(1, 2), (2, 1)}}.get(case, set())
    want_n = {"one_node": 4, "two_hosts": 2, "explicit_2": 2, "explicit_1": 1, "no_peer_in_node": 4,
              "no_peer_across": 2, "interleaved": None}[case]
    want_ok = case not in ("no_peer_in_node", "interleaved")
    def runtime(me):  # what rank me sees: the GPUs of its host, ordinals by bus id
        visible = {buses[r]: int(ident[r, 2]) for r in range(R) if hosts[r] == hosts[me]}
        rt = _Runtime(visible, {(a, b): (a, b) not in no_peer for a in range(R) for b in range(R)})
        rt.deviceGetPCIBusId = lambda dev: buses[me]
        return rt

    verdicts = []  # each rank's own verdict on its node's peers
    for me in range(R):
        lo = me // want_n * want_n if want_n else 0
        reason = _ep_direct.local_reason(ident, me, int(ident[me, 2]), runtime(me), peers=range(lo, lo + want_n)) \
            if want_n else "no nodes"
        verdicts.append([0 if reason else 1])
    for me in range(R):
        calls = []

        def gather(comm, values, stream, wait):
            calls.append(list(values))
            return ident if len(calls) == 1 else np.array(verdicts, np.int64)

        monkeypatch.setattr(_ep_direct, "all_gather_int64", gather)
        monkeypatch.setattr(_ep_direct, "host_identity", lambda: hosts[me])
        comm = type("C", (), {"rank": me, "size": R})()
        n, ok, why = _ep_direct._decide_nodes(comm, int(ident[me, 2]), None, None, runtime(me), given)
        assert n == want_n, (case, me, n)
        assert len(calls) == (1 if want_n is None else 2)  # the same on every rank: no mismatched collective
        assert calls[0][0] == hosts[me]
        if want_n is not None:
            assert calls[1] == verdicts[me]
        assert ok == want_ok and (ok or why), (case, me, why)
    if case == "no_peer_across":  # ranks 1 and 2 lack peer access, but they are on different nodes
        assert verdicts == [[1]] * R


class _Dev:
    """A stand-in device array: shape, dtype and an address (the traced ops take pointers and row slices)."""
    _next = [1 << 32]

    def __init__(self, shape, dtype, ptr=None):
        self.shape = tuple(int(n) for n in (shape if isinstance(shape, tuple) else (shape,)))
        self.dtype = np.dtype(dtype)
        self.size = int(np.prod(self.shape))
        if ptr is None:
            ptr = _Dev._next[0]
            _Dev._next[0] += (self.size * self.dtype.itemsize + 255) // 256 * 256 + 256
        self.data = _Ptr(ptr)

    def row_bytes(self):
        return int(np.prod(self.shape[1:])) * self.dtype.itemsize

    def __getitem__(self, sl):
        start, stop, _ = sl.indices(self.shape[0])
        return _Dev((stop - start,) + self.shape[1:], self.dtype, self.data.ptr + start * self.row_bytes())

    def reshape(self, *shape):
        return _Dev(shape, self.dtype, self.data.ptr)

    @staticmethod
    def empty(shape, dtype):
        return _Dev(shape, dtype)


class _DevHandle:
    """A stand-in handle: sizes, mode, host counts (exact mode) and one device region per name (1 << 16
    elements each, in one buffer)."""

    def __init__(self, sizes, mode, host_meta=None):
        self.sizes, self.mode, self.state, self._v = sizes, mode, {"host_meta": host_meta}, {}
        self.layout = {name: (i << 18, dt, 1 << 16) for i, (name, dt, _) in enumerate(_handle.REGIONS)}
        self.buffer = _Dev(len(self.layout) << 18, np.uint8)

    def view(self, name):
        if name not in self._v:
            off, dt, n = self.layout[name]
            self._v[name] = _Dev(n, dt, self.buffer.data.ptr + off)
        return self._v[name]


def _mixed_transport(monkeypatch, R, local_size, me, P, events, kernels=None):
    """A MixedTransport of rank ``me`` (kernels, NCCL and the IPC-shared stages stood in for; the core's direct
    launches planned in a planning context, their full kernel names listed by base name in ``kernels``)."""
    from moe_rt import _core, _ep_direct, _ep_mixed, _ep_nccl, _ep_rows, _jit, permutation

    def launch(fn, grid, block, args, *, shared_mem=0, stream=None):
        name = fn.name.split("<")[0]
        assert len(args) == len(_kernel_params("ep.cu", name)), name
        events.append(("launch", name, args))

    def launch_raw(fn, grid, block, args, shared_mem, stream):
        launch(fn, grid, block, args, shared_mem=shared_mem, stream=stream)

    monkeypatch.setattr(_jit, "function", lambda file, name: _Kernel(name))
    monkeypatch.setattr(_jit, "launch", launch)
    monkeypatch.setattr(_jit, "launch_raw", launch_raw)
    monkeypatch.setattr(_jit, "set_max_dynamic_shared", lambda fn, n: None)
    monkeypatch.setattr(_jit, "device_properties", lambda dev: {"sm_count": 4})
    ctx = _core.planning(sm_count=4, assumed_regs=65536 // (512 * 2) // 8 * 8)  # 8 resident fused blocks

    def recorded(f):  # a core call, then its launches as the planning context recorded them
        def call(*args):
            f(*args)
            for i, l in enumerate(ctx.last_plan()):
                if kernels is not None:
                    kernels.setdefault(l[1].split("<")[0], []).append(l[1])
                launch(_Kernel(l[1]), l[2], l[3], ctx.last_plan_args(i))
        return call

    for name in ("ep_direct_barrier", "ep_direct_dispatch", "ep_direct_combine"):
        monkeypatch.setattr(_core, name, recorded(getattr(_core, name)))
    monkeypatch.setattr(_ep_mixed, "_subplan", lambda h, lo, hi: ("rows", lo, hi))
    monkeypatch.setattr(_ep_rows, "_launches", {})  # set-ups made with the stand-in kernels stay here

    def combine(y, plan, w=None, *, stream=None):
        events.append(("combine", plan, None if w is None else w.data.ptr))
        return _Dev((plan[2] - plan[1], y.shape[1]), y.dtype)

    def dispatch_backward(y, plan, gw=None, *, stream=None):
        events.append(("dispatch_backward", plan))
        return _Dev((plan[2] - plan[1], y.shape[1]), y.dtype), None

    monkeypatch.setattr(permutation, "combine", combine)
    monkeypatch.setattr(permutation, "dispatch_backward", dispatch_backward)

    class Comm(_RecComm):
        def send(self, ptr, count, dtype, peer, stream):
            events.append(("send", peer, count, ptr))

        def recv(self, ptr, count, dtype, peer, stream):
            events.append(("recv", peer, count, ptr))

        def group_start(self):
            events.append(("group_start",))

        def group_end(self):
            events.append(("group_end",))

    comm = Comm(me, R)
    lo = me // local_size * local_size
    d = object.__new__(_ep_direct.DirectTransport)  # what __init__ sets, without the CUDA calls
    d.comm, d.device, d.R, d.me, d.lo, d.hi, d.P = comm, 0, R, me, lo, lo + local_size, P
    d.timeout_ns, d._stages, d._order, d.closed, d._err_ptr = 10**9, {}, [], False, 64
    d._pairs, d._views = {}, {}
    d._scratch_mem, d._retired = {}, []
    d._wait, d._op_wait = None, lambda op: None
    d.state = _Dev(4, np.uint32)
    d.bar = d.flags = type("Sh", (), {"table": _Dev(R, np.int64)})()
    d._core = _core.ep_direct_group_create(ctx, R, me, lo, lo + local_size, P, 10**9, d.bar.table.data.ptr,
                                           d.flags.table.data.ptr, d.state.data.ptr, d._err_ptr)
    d.view = lambda st, rows, cols, dtype: _Dev((rows, cols), dtype, st.local)

    def stages(row_bytes, K, stream, wait=None):
        out = []
        for key, rb in ((("rows", row_bytes), row_bytes), (("weights", K), 4 * K)):
            if key not in d._stages:
                local = _Dev(R * P * rb, np.uint8).data.ptr
                d._stages[key] = type("St", (), {"local": local, "ptrs": [local + (r << 24) for r in range(R)],
                                                  "table": _Dev(R, np.int64), "nbytes": R * P * rb})()
            out.append(d._stages[key])
        d._core.add_stage(row_bytes, K, _ep_direct._stage_unit(out[0]), out[0].local, out[0].table.data.ptr,
                          out[1].local, out[1].table.data.ptr)  # as DirectTransport.stages registers a new pair
        return out

    d.stages = stages
    nc = _ep_nccl.NcclTransport(comm, me, R, 0, 8, 1, False)
    return _ep_mixed.MixedTransport(d, nc)


def _mixed_handle(R, me, P, K, mode, rng):
    """Sizes and, in exact mode, host counts (kept rows per pair, offsets) of a stand-in handle."""
    T, L = 2 * P, 2
    sz = dict(R=R, rank=me, L=L, E=L * R, Tmax=2 * P, K=K, P=P, T=T, H=8, A=1)
    if mode == "capacity":
        sz.update(rows=R * P, N=R * P * K)
        return _DevHandle(sz, mode)
    sc = [int(v) for v in rng.integers(0, P + 1, R)]
    rc = [int(v) for v in rng.integers(0, P + 1, R)]
    rc[me] = sc[me]
    so, o = [], 0
    for p in range(R):
        so.append(o)
        o += 0 if p == me else sc[p]
    ro = list(np.concatenate([[0], np.cumsum(rc)]).astype(int))
    meta = np.zeros(5 * R + 10, np.int32)
    for name, vals in (("send_counts", sc), ("recv_counts", rc), ("send_off", so), ("recv_off", ro[:R])):
        meta[_handle.meta_index(name, R):][:R] = vals
    meta[_handle.meta_index("send_rows", R)] = sum(sc) - sc[me]
    sz.update(rows=int(ro[R]), N=int(ro[R]) * K)
    return _DevHandle(sz, mode, meta)


@pytest.mark.parametrize("R,local_size,me", [(4, 2, 1), (4, 2, 2), (2, 1, 0), (2, 1, 1)])
@pytest.mark.parametrize("mode", ["capacity", "exact"])
def test_mixed_op_trace(monkeypatch, rng, R, local_size, me, mode):
    """The launches and NCCL calls of the mixed transport's ops, traced on the CPU: the barrier and the fused
    direct kernels serve the node's ranks [lo, lo + local_size) (their arguments), NCCL carries exactly the rows
    of the other nodes' ranks (peers, sizes, addresses: out of the send buffer at send_off, into the receive
    layout at recv_off; in the combine direction straight into the owner's stage row p*P + pos), the remote
    rows are expanded into the same expert-major rows, and each launch passes as many arguments as its kernel
    takes."""
    from moe_rt import _ep_direct

    events = []
    P, K, H = 5, 2, 8
    t = _mixed_transport(monkeypatch, R, local_size, me, P, events)
    lo, hi = me // local_size * local_size, me // local_size * local_size + local_size
    node = set(range(lo, hi))
    remote = [p for p in range(R) if p not in node]
    h = _mixed_handle(R, me, P, K, mode, rng)
    sc, so, rc, ro = t.nccl._host_counts(h)
    rb = H * 4
    call = type("Call", (), {"xp": _Dev, "empty": staticmethod(_Dev.empty), "stream": type("S", (), {"ptr": 9})(),
                             "stream_ptr": 9, "device_id": 0})()
    x = _Dev((h.sizes["T"], H), np.float32)
    w = _Dev((h.sizes["T"], K), np.float32)

    def launches(name):
        return [e[2] for e in events if e[0] == "launch" and e[1] == name]

    def nccl(kind):
        return [e[1:] for e in events if e[0] == kind]

    # -- the dispatch direction, expanded into the expert-major rows
    out, out_w = t.forward(call, h, x, w, "dispatch", want_w=True)
    assert out.shape == (h.sizes["N"], H) and out_w.shape == (h.sizes["N"],)
    names = [e[1] if e[0] == "launch" else e[0] for e in events]
    direct = ["ep_direct_barrier", "ep_direct_dispatch"] + (["ep_direct_row_map"] if mode == "exact" else [])
    # the direct pass's kernel writes its rows' weights into recv_wk, before the NCCL pass writes the remote ones
    groups = ["group_start"] + ["send", "send", "recv", "recv"] * len(remote) + ["group_end"]
    expands = ["ep_expand_rows"] * len(t.remote_ranges())
    assert names == direct + ["ep_pack_rows"] + groups + expands + ["ep_fill_rows"], names
    bar, = launches("ep_direct_barrier")
    assert tuple(int(v) for v in bar[-3:]) == (_ep_direct.OP_CODES["dispatch"], lo, hi)
    disp, = launches("ep_direct_dispatch")
    assert tuple(int(v) for v in disp[-2:]) == (lo, hi)
    pack, = launches("ep_pack_rows")
    assert tuple(int(v) for v in pack[-3:]) == (1, lo, hi)  # only the destinations outside the node
    sends, recvs = nccl("send"), nccl("recv")
    assert [s[0] for s in sends] == [p for p in remote for _ in (0, 1)]
    assert [r[0] for r in recvs] == [p for p in remote for _ in (0, 1)]
    sbuf = sends[0][2] - so[remote[0]] * rb
    for i, p in enumerate(remote):
        assert sends[2 * i][1:] == (sc[p] * rb, sbuf + so[p] * rb)  # rows
        assert sends[2 * i + 1][1] == sc[p] * K * 4  # weights
        assert recvs[2 * i][1] == rc[p] * rb
        assert recvs[2 * i + 1][1:] == (rc[p] * K * 4, h.view("recv_wk").data.ptr + ro[p] * K * 4)
    rbuf = recvs[0][2] - ro[remote[0]] * rb
    assert [r[2] for r in recvs[::2]] == [rbuf + ro[p] * rb for p in remote]
    ranges = t.remote_ranges()
    for args, (a, b) in zip(launches("ep_expand_rows"), ranges):
        first, last = ro[a], ro[b - 1] + rc[b - 1]
        assert args[0] == rbuf + first * rb  # the remote sources' received rows
        assert args[2] == h.view("dst_row").data.ptr + first * K * 4 and int(args[6]) == last - first

    # -- the dispatch direction, received rows in the handle's layout (combine_bwd with y)
    events.clear()
    buf = t.forward(call, h, x, None, "combine_bwd", expand=False)
    names = [e[1] if e[0] == "launch" else e[0] for e in events]
    direct = ["ep_direct_barrier", "ep_direct_dispatch"]
    if mode == "exact":  # the stage's rows packed into the handle's layout (the row map is cached on the handle)
        direct += ["ep_copy_rows"]
    groups = ["group_start"] + ["send", "recv"] * len(remote) + ["group_end"]
    assert names == direct + ["ep_pack_rows"] + groups, names
    stage = t.direct._stages[("rows", rb)].local
    assert buf.data.ptr == (stage if mode == "capacity" else buf.data.ptr) and buf.shape == (h.sizes["rows"], H)
    assert [r[1:] for r in nccl("recv")] == [(rc[p] * rb, buf.data.ptr + ro[p] * rb) for p in remote]

    # -- the combine direction: remote partials through NCCL into the owners' stages, then the direct kernel
    for op in ("combine", "dispatch_bwd"):
        events.clear()
        y = _Dev((h.sizes["N"], H), np.float32)
        wk = _Dev((h.sizes["rows"], K), np.float32) if op == "combine" else None
        gw = _Dev(h.sizes["N"], np.float32) if op == "dispatch_bwd" else None
        o, g = t.reduce(call, h, y, wk, gw, op)
        assert o.shape == (h.sizes["T"], H) and (g is None) == (gw is None)
        names = [e[1] if e[0] == "launch" else e[0] for e in events]
        partial = "combine" if op == "combine" else "dispatch_backward"
        n_w = 2 if gw is not None else 1
        want = (["ep_slot_values"] if gw is not None else []) + ["ep_direct_barrier"]
        want += [partial] * len(ranges) + ["group_start"] + (["send"] * n_w + ["recv"] * n_w) * len(remote)
        want += ["group_end", "ep_direct_combine"]
        assert names == want, (op, names)
        bar, = launches("ep_direct_barrier")
        assert tuple(int(v) for v in bar[-3:]) == (_ep_direct.OP_CODES[op], lo, hi)
        comb, = launches("ep_direct_combine")
        assert tuple(int(v) for v in comb[-2:]) == (lo, hi)
        parts = [e for e in events if e[0] in ("combine", "dispatch_backward")]
        assert [e[1][1:] for e in parts] == [(ro[a], ro[b - 1] + rc[b - 1]) for a, b in ranges]
        if op == "combine":
            assert [e[2] for e in parts] == [wk.data.ptr + ro[a] * K * 4 for a, _ in ranges]
        stage = t.direct._stages[("rows", rb)].local
        wstage = t.direct._stages[("weights", K)].local
        recvs = [e[1:] for e in events if e[0] == "recv"]
        sends = [e[1:] for e in events if e[0] == "send"]
        # back to the owner: what this rank received from p; into this rank's stage rows p*P + pos
        assert [r[:2] for r in recvs[::n_w]] == [(p, sc[p] * rb) for p in remote]
        assert [r[2] for r in recvs[::n_w]] == [stage + p * P * rb for p in remote]
        assert [s[:2] for s in sends[::n_w]] == [(p, rc[p] * rb) for p in remote]
        if gw is not None:
            assert [r[1:] for r in recvs[1::2]] == [(sc[p] * K * 4, wstage + p * P * K * 4) for p in remote]
            assert [s[1] for s in sends[1::2]] == [rc[p] * K * 4 for p in remote]


# -- FP8 dispatch: one pass of the transport over packed rows (docs/ep.md §9), traced on the CPU ----------------

class _Dev8(_Dev):
    """_Dev with what EpGroup.dispatch's checks read of an array."""

    @property
    def ndim(self):
        return len(self.shape)

    def astype(self, dtype, copy=True):
        return self

    @staticmethod
    def empty(shape, dtype):
        return _Dev8(shape, dtype)

    @staticmethod
    def ascontiguousarray(a):
        return a


def test_fp8_packed_layout():
    """The packed row: H codes, at ceil4(H) the ceil(H/128) fp32 scales, padded to a multiple of 16 bytes; the
    sink's piece divides the codes, the gap and the scales (16 for H = 7168: 7392-byte rows)."""
    from moe_rt._ep_rows import Fp8Rows
    from moe_rt.fp8 import packed_layout

    assert packed_layout(7168) == (56, 7168, 7392)
    for H, want in ((7168, (56, 7168, 7392, 16)), (512, (4, 512, 528, 16)), (300, (3, 300, 320, 4)),
                    (100, (1, 100, 112, 4)), (77, (1, 80, 96, 1)), (2880, (23, 2880, 2976, 4)), (1, (1, 4, 16, 1))):
        r = Fp8Rows(H)
        assert (r.S, r.scale_at, r.row_bytes, r.piece) == want, H
        assert r.row_bytes % 16 == 0 and r.row_bytes - (r.scale_at + 4 * r.S) < 16
    a = type("A", (), {"data": _Ptr(1 << 20)})()
    assert Fp8Rows(7168).sink((a, a)) == ("Fp8Rows<16>", 1 << 20, 1 << 20, np.int32(7168))
    assert Fp8Rows(7168, "bfloat16").sink((a,))[:3] == ("Fp8Dequant<__nv_bfloat16, 16>", 1 << 20, 0)
    odd = type("A", (), {"data": _Ptr((1 << 20) + 4)})()  # an output aligned to 4 bytes only: narrower pieces
    assert Fp8Rows(7168).sink((odd, a))[0] == "Fp8Rows<4>"
    assert Fp8Rows(7168, np.float32).sink((odd,))[0] == "Fp8Dequant<float, 1>"
    names = Fp8Rows.sink_names()
    assert len(names) == len(set(names)) == 12 and "Fp8Dequant<__half, 4>" in names


def test_fp8_rows_outputs_come_from_the_given_allocator():
    """Fp8Rows.empty takes an allocator (cupy.empty, or a call's empty: torch's allocator in a lean torch call)
    and the codes' dtype: the direct transport asks for the codes in the dtype the caller gets back (an FP8 dtype
    for a float x, so no view is made afterwards), the NCCL and mixed ones for uint8 (CuPy holds no FP8)."""
    from moe_rt._arrays import FLOAT8_E4M3
    from moe_rt._ep_rows import Fp8Rows

    got = []

    def alloc(shape, dtype):
        got.append((tuple(shape), np.dtype(dtype)))
        return len(got)

    rows = Fp8Rows(300, codes=FLOAT8_E4M3)
    assert rows.codes == FLOAT8_E4M3 and Fp8Rows(300).codes == np.uint8
    assert rows.empty(alloc, 7, rows.codes) == (1, 2)
    assert got == [((7, 300), FLOAT8_E4M3), ((7, 3), np.dtype(np.float32))]
    got.clear()
    rows.empty(alloc, 7)
    assert got == [((7, 300), np.dtype(np.uint8)), ((7, 3), np.dtype(np.float32))]
    got.clear()
    assert Fp8Rows(300, np.float32, codes=FLOAT8_E4M3).empty(alloc, 5, FLOAT8_E4M3) == (1,)
    assert got == [((5, 300), np.dtype(np.float32))]


@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("dequantize", [False, True])
def test_fp8_dispatch_one_transport_pass(monkeypatch, pair, dequantize):
    """EpGroup.dispatch(fp8=True) on CUDA (arrays, kernels, the core and the transport stood in for): one kernel
    writes the packed rows (the core's quantize into packed rows from x, on the call's stream pointer, or
    fp8_pack_rows from a pair), then exactly one transport forward over them, with the weights and the Fp8Rows
    of the outputs; nothing runs after it (no second pass for the scales, no dequantize or split kernel)."""
    from moe_rt import _arrays, _core, _jit, _ep_rows
    from moe_rt import ep as ep_mod
    from moe_rt.reference import fp8 as fref

    launches, passes = [], []
    E, H, Tmax, K, T = 8, 300, 16, 2, 11
    g = EpGroup(None, E, H, Tmax)
    h = g.prepare(np.arange(T * K).reshape(T, K).astype(np.int32) % E)  # a CPU handle, taken for a CUDA one
    h.state.update(backend="cuda", device_id=0)

    def launch(fn, grid, block, args, *, shared_mem=0, stream=None):
        launches.append((fn.name, args))

    monkeypatch.setattr(_jit, "function", lambda file, name: _Kernel(name))
    monkeypatch.setattr(_jit, "launch", launch)
    monkeypatch.setattr(_jit, "device_properties", lambda dev: {"sm_count": 4})
    monkeypatch.setattr(_core, "device", lambda dev: "core context")
    monkeypatch.setattr(_core, "quantize_fp8_rows", lambda *a: launches.append(("quantize_fp8_rows", a)))
    monkeypatch.setattr(_core, "pack_fp8_rows", lambda *a: launches.append(("pack_fp8_rows", a)))
    monkeypatch.setattr(_arrays, "contiguous", lambda xp, a: a)
    monkeypatch.setattr(_arrays, "cupy_of", lambda a: a)
    monkeypatch.setattr(_arrays, "fp8_array", lambda a, dt: ("fp8", a))
    stream = type("S", (), {"ptr": 9})()

    class Call:
        backend, framework, device_id, xp, stream_ptr = "cuda", "torch", 0, _Dev8, 9

        def __init__(self, arrays, stream=None, **kw):
            self.arrays, self.stream = arrays, stream_

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def __getitem__(self, name):
            return self.arrays[name]

        def out(self, a):
            return a

        @staticmethod
        def empty(shape, dtype):
            return _Dev8(shape, dtype)

    stream_ = stream
    monkeypatch.setattr(_arrays, "Call", Call)

    class Rec:
        def forward(self, call, h, x, w, op, *, expand=True, want_w=False, fp8=None, zero=True, tpe=None):
            passes.append((x, w, op, expand, want_w, fp8, len(launches), zero, tpe))
            N = h.sizes["N"]
            return fp8.empty(call.empty, N), (_Dev8(N, np.float32) if want_w else None)

    g._transport = Rec()
    S = fref.num_blocks(H, 128)
    w = _Dev8((T, K), np.float32)
    x = (_Dev8((T, H), np.uint8), _Dev8((T, S), np.float32)) if pair else _Dev8((T, H), _arrays.BFLOAT16)
    out = g.dispatch(h, x, w, fp8=True, dequantize=dequantize)
    assert len(passes) == 1  # one transport pass: codes and scales together
    px, pw, op, expand, want_w, rows, at, zero, tpe = passes[0]
    # tokens_per_local_expert: the transport copies it into the returned array (no copy after the pass)
    assert (tpe.shape, tpe.dtype) == ((h.sizes["L"],), np.int32) and out[-1] is tpe
    assert zero is True  # zero_empty_slots' default reaches the transport
    assert isinstance(rows, _ep_rows.Fp8Rows) and (op, expand, want_w, pw) == ("dispatch", True, True, w)
    assert px.shape == (T, rows.row_bytes) == (T, 320) and px.dtype == np.uint8
    assert [n for n, _ in launches] == (["pack_fp8_rows"] if pair else ["quantize_fp8_rows"])
    assert at == 1  # the packing kernel, then the pass; nothing after it
    args = launches[0][1]
    if pair:  # codes, scales -> the packed rows of row_bytes, through the core on stream 9
        assert args == ("core context", x[0].data.ptr, x[1].data.ptr, T, H, 128, px.data.ptr, rows.row_bytes, 9)
    else:  # x -> the packed rows of row_bytes (the core puts the scales at byte ceil4(H)), on stream 9
        assert args == ("core context", x.data.ptr, _core.CODES[np.dtype(_arrays.BFLOAT16)], T, H, 128,
                        px.data.ptr, rows.row_bytes, 9)
    N = h.sizes["N"]
    if dequantize:
        y, rw, _ = out
        assert rows.dtype == np.dtype(_arrays.BFLOAT16) and y.shape == (N, H) and y.dtype == rows.dtype
    else:
        q, s, rw, _ = out
        assert rows.dtype is None
        q = q if pair else q[1]  # a float x: the codes come back as float8_e4m3fn (fp8_array)
        assert q.shape == (N, H) and q.dtype == np.uint8 and s.shape == (N, S) and s.dtype == np.float32
    g.dispatch(h, x, w, fp8=True, dequantize=dequantize, zero_empty_slots=False)
    assert len(passes) == 2 and passes[1][7] is False and len(launches) == 2  # the same pass, zero=False


@pytest.mark.parametrize("kind", ["direct", "mixed", "nccl"])
@pytest.mark.parametrize("mode", ["capacity", "exact"])
@pytest.mark.parametrize("dequantize", [False, True])
def test_fp8_transport_one_pass_trace(monkeypatch, rng, kind, mode, dequantize):
    """A transport's forward over packed FP8 rows (fp8=Fp8Rows), traced on the CPU: one barrier and one fused
    ep_direct_dispatch whose sink splits (or dequantizes) the rows into the outputs as it expands them (direct,
    and the mixed transport's node pass), one NCCL group carrying rows of row_bytes, ep_expand_rows with the
    same sink for the rows received through NCCL (mixed; the NCCL transport's serial path too, instead of the
    permutation family's dispatch), then fill_rows over each output; each launch passes as many arguments as
    its kernel takes."""
    from moe_rt import _jit, permutation
    from moe_rt._ep_rows import Fp8Rows

    events = []
    R, local_size, me, P, K = (4, 2, 1, 5, 2) if kind == "mixed" else (2, 2, 0, 5, 2)
    full = {}
    t = _mixed_transport(monkeypatch, R, local_size, me, P, events, full)
    monkeypatch.setattr(permutation, "dispatch", lambda *a, **k: events.append(("permutation.dispatch",)))
    if kind == "direct":
        t = t.direct
    elif kind == "nccl":
        t = t.nccl
    h = _mixed_handle(R, me, P, K, mode, rng)
    H = 100
    rows = Fp8Rows(H, np.float32 if dequantize else None)
    call = type("Call", (), {"xp": _Dev, "empty": staticmethod(_Dev.empty), "stream": type("S", (), {"ptr": 9})(),
                             "stream_ptr": 9, "device_id": 0})()
    x = _Dev((h.sizes["T"], rows.row_bytes), np.uint8)
    w = _Dev((h.sizes["T"], K), np.float32)
    monkeypatch.setattr(_jit, "function", lambda file, name: (full.setdefault(name.split("<")[0], []).append(name),
                                                               _Kernel(name))[1])
    out, out_w = t.forward(call, h, x, w, "dispatch", want_w=True, fp8=rows)
    N = h.sizes["N"]
    if dequantize:
        assert len(out) == 1 and out[0].shape == (N, H) and out[0].dtype == np.float32
    else:
        assert [(o.shape, o.dtype) for o in out] == [((N, H), np.uint8), ((N, 1), np.float32)]
    assert out_w.shape == (N,)
    names = [e[1] if e[0] == "launch" else e[0] for e in events]
    assert "permutation.dispatch" not in names
    sink = "Fp8Dequant<float, 4>" if dequantize else "Fp8Rows<4>"
    # the direct transport's dispatch kernel zeroes the rows holding no slot and lays out the weights (no
    # ep_fill_rows); the mixed transport's fill runs after its NCCL pass and zeroes them there
    fills = ["ep_fill_rows"] * (0 if kind == "direct" else len(out))
    if kind in ("direct", "mixed"):
        assert names.count("ep_direct_barrier") == 1 and names.count("ep_direct_dispatch") == 1
        assert full["ep_direct_dispatch"] == [f"ep_direct_dispatch<uint4, 8, {sink}>"]
        disp = next(e[2] for e in events if e[0] == "launch" and e[1] == "ep_direct_dispatch")
        assert (disp[0], disp[8], disp[10]) == (x.data.ptr, out[0].data.ptr, H)
        assert disp[9] == (0 if dequantize else out[1].data.ptr)
        assert int(disp[-3]) == rows.row_bytes // 16  # units of the packed row
        zero_src, zero_n, zero_rows, recv_wk, w_travel, lay_w = disp[11:17]
        assert (zero_src != 0, int(zero_n), int(zero_rows)) == ((True, N, 1) if kind == "direct" else (False, 0, 0))
        assert (recv_wk != 0, int(w_travel)) == (True, 1)  # the weights travel (recv_wk: the handle's)
        assert (lay_w != 0) == (kind == "direct")  # the laid-out weights: the direct kernel's
        stages = (t.direct if kind == "mixed" else t)._stages  # one stage: rows of row_bytes
        assert ("rows", rows.row_bytes) in stages and len([k for k in stages if k[0] == "rows"]) == 1
    if kind == "direct":
        assert "ep_fill_rows" not in names and "ep_expand_rows" not in names and "group_start" not in names
    else:
        remote = [p for p in range(R) if (not t.lo <= p < t.hi if kind == "mixed" else p != me)]
        assert names.count("group_start") == 1  # one NCCL group: every row with its scales
        sends = [e for e in events if e[0] == "send"][::2]
        sc, _, rc, _ = (t.nccl if kind == "mixed" else t)._host_counts(h)
        assert [(e[1], e[2]) for e in sends] == [(p, sc[p] * rows.row_bytes) for p in remote if sc[p]]
        exp = [e[2] for e in events if e[0] == "launch" and e[1] == "ep_expand_rows"]
        assert exp and set(full["ep_expand_rows"]) == {f"ep_expand_rows<uint4, 4, {sink}>"}
        for a in exp:
            assert (a[1], a[-1]) == (out[0].data.ptr, H) and a[-2] == (0 if dequantize else out[1].data.ptr)
            assert int(a[5]) == rows.row_bytes // 16
        if kind == "nccl":  # the serial path expands every received row, the own share too, in one launch
            assert len(exp) == 1 and int(exp[0][6]) == h.sizes["rows"]
        assert names[-len(fills):] == fills
    fill_args = [e[2] for e in events if e[0] == "launch" and e[1] == "ep_fill_rows"]
    addr = (lambda a: a.data.ptr if isinstance(a, _Dev) else int(a))  # the core's launches carry addresses
    if kind == "direct":
        assert fill_args == [] and addr(lay_w) == out_w.data.ptr
    else:
        assert [a[0] for a in fill_args] == [o.data.ptr for o in out]
        assert addr(fill_args[0][1]) == out_w.data.ptr and all(addr(a[1]) == 0 for a in fill_args[1:])


class _StandInStream:
    """A stand-in CuPy stream or event for the NCCL transport's overlapped path (events and waits recorded as
    nothing)."""
    ptr = 9

    def wait_event(self, ev):
        pass

    def record(self, stream=None):
        pass


@pytest.mark.parametrize("kind", ["direct", "mixed", "nccl", "nccl overlapped"])
@pytest.mark.parametrize("mode", ["capacity", "exact"])
@pytest.mark.parametrize("rows_kind", ["plain", "fp8", "fp8 dequant"])
@pytest.mark.parametrize("want_w", [True, False])
def test_transport_zero_empty_slots_trace(monkeypatch, rng, kind, mode, rows_kind, want_w):
    """A transport's forward with zero=False (dispatch's zero_empty_slots=False), traced on the CPU beside the
    same forward with zero=True: the same expand launches with the same arguments (the outputs aside), but
    no output reaches ep_fill_rows: it runs once for the weights alone (out = 0, 0 units) or not at all;
    with zero=True it gets every output (plain rows, the FP8 codes and scales, or the dequantized rows), but
    on the direct transport, whose dispatch kernel zeroes those rows itself (given src_slot), only the weights. The
    NCCL transport's serial path of plain rows expands with ep_expand_rows (every received row, one launch)
    instead of the permutation family's dispatch, which zeroes the rows holding no slot."""
    from moe_rt import _ep_nccl, _jit, permutation
    from moe_rt._ep_rows import Fp8Rows

    events = []
    R, local_size, me, P, K = (4, 2, 1, 5, 2) if kind == "mixed" else (2, 2, 0, 5, 2)
    t = _mixed_transport(monkeypatch, R, local_size, me, P, events)
    monkeypatch.setattr(_ep_nccl, "plan_view", lambda h: "plan")
    monkeypatch.setattr(permutation, "dispatch", lambda x, plan, w=None, **k: (
        events.append(("permutation.dispatch", w is not None)), (_Dev((N, x.shape[1]), x.dtype),
                                                                 _Dev(N, np.float32) if w is not None else None))[1])
    if kind == "direct":
        t = t.direct
    elif kind.startswith("nccl"):
        t = t.nccl
        if kind == "nccl overlapped":
            t.overlap = True
            st = _StandInStream()
            monkeypatch.setattr(t, "_comm_stream", lambda: st)
            monkeypatch.setattr(t, "_event", lambda i: st)
    h = _mixed_handle(R, me, P, K, mode, rng)
    N, H = h.sizes["N"], 100
    fp8 = None if rows_kind == "plain" else Fp8Rows(H, np.float32 if rows_kind == "fp8 dequant" else None)
    call = type("Call", (), {"xp": _Dev, "empty": staticmethod(_Dev.empty), "stream": _StandInStream(),
                             "stream_ptr": _StandInStream.ptr, "device_id": 0})()
    x = _Dev((h.sizes["T"], H), np.float32) if fp8 is None else _Dev((h.sizes["T"], fp8.row_bytes), np.uint8)
    w = _Dev((h.sizes["T"], K), np.float32) if want_w else None
    full = []
    monkeypatch.setattr(_jit, "function", lambda file, name: (full.append(name), _Kernel(name))[1])
    t.forward(call, h, x, w, "dispatch", want_w=want_w, fp8=fp8)  # the stages made once, before both runs
    runs, start = {}, _Dev._next[0]
    for zero in (True, False):
        events.clear()
        full.clear()
        _Dev._next[0] = start  # both runs allocate at the same addresses (in the same order)
        out, out_w = t.forward(call, h, x, w, "dispatch", want_w=want_w, fp8=fp8, zero=zero)
        outs = (out,) if fp8 is None else out
        assert (out_w is not None) == want_w
        # every launch's arguments as ints, the outputs' addresses replaced by their names
        norm = {o.data.ptr: f"out{i}" for i, o in enumerate(outs + ((out_w,) if want_w else ()))}
        ints = [[a.data.ptr if isinstance(a, _Dev) else int(a) for a in e[2]] if e[0] == "launch" else None
                for e in events]
        trace = [(e[0], e[1], tuple(norm.get(a, a) for a in v)) if v is not None else e[:2]
                 for e, v in zip(events, ints)]
        runs[zero] = (trace, list(full), outs)
    (t_zero, _, outs_z), (t_nz, f_nz, outs) = runs[True], runs[False]
    fills = [e for e in t_nz if e[0] == "launch" and e[1] == "ep_fill_rows"]
    if kind == "direct":  # the dispatch kernel lays out the weights: no ep_fill_rows in either run
        assert fills == []
    elif want_w:
        assert len(fills) == 1 and fills[0][2][0] == 0 and fills[0][2][1] == "out" + str(len(outs))
        assert int(fills[0][2][-1]) == 0  # no row units: nothing but the weights
    else:
        assert fills == []
    fills_z = [e for e in t_zero if e[0] == "launch" and e[1] == "ep_fill_rows"]
    if kind == "nccl" and fp8 is None:  # zero=True: the permutation family's dispatch; False: one ep_expand_rows
        assert [e for e in t_zero if e[0] == "permutation.dispatch"] == [("permutation.dispatch", want_w)]
        exp = [e for e in t_nz if e[0] == "launch" and e[1] == "ep_expand_rows"]
        assert len(exp) == 1 and exp[0][2][1] == "out0" and int(exp[0][2][6]) == h.sizes["rows"]
        assert set(n_ for n_ in f_nz if n_.startswith("ep_expand_rows")) == {"ep_expand_rows<uint4, 4>"}
        assert "permutation.dispatch" not in [e[0] for e in t_nz]
    elif kind == "direct":  # zero=True: ep_direct_dispatch zeroes the rows holding no slot itself (zero_src,
        # zero_n: the handle's src_slot and N; zero_rows = 1), and its zero items zero the laid-out weights there
        # in both runs; zero=False: the same launches, zero_rows = 0 (and no zero items without weights)
        (dz,), (dn,) = ([e for e in t_ if e[1:2] == ("ep_direct_dispatch",)] for t_ in (t_zero, t_nz))
        assert dz[2][11] != 0 and int(dz[2][12]) == N and int(dz[2][13]) == 1 and int(dn[2][13]) == 0
        assert dn[2][11:13] == (dz[2][11:13] if want_w else (0, 0))
        assert dz[2][:11] + dz[2][14:] == dn[2][:11] + dn[2][14:]
        assert fills_z == fills
        assert [e for e in t_nz if e[1:2] != ("ep_direct_dispatch",)] == [
            e for e in t_zero if e[1:2] != ("ep_direct_dispatch",)]
    else:  # zero=True zeroes every output with ep_fill_rows; zero=False has the same launches but those
        assert [e[2][0] for e in fills_z if e[2][0] != 0] == [f"out{i}" for i in range(len(outs_z))]
        assert [e for e in t_nz if e[1:2] != ("ep_fill_rows",)] == [e for e in t_zero if e[1:2] != ("ep_fill_rows",)]


def test_fp8_sink_kernels_compile():
    """The FP8 sinks of ep_expand_rows (the NCCL and mixed transports' expand of packed FP8 rows) compile for
    sm_90, every registered one in one program (ep_direct_dispatch's: test_direct_kernels_compile)."""
    from moe_rt import _jit
    from moe_rt._ep_rows import Fp8Rows

    names = [f"ep_expand_rows<uint4, 4, {k}>" for k in Fp8Rows.sink_names()]
    assert set(names) <= set(_jit.REGISTRY["ep.cu"])
    image, lowered = _jit.compile_offline("ep.cu", "sm_90", names)
    assert set(lowered) == set(names)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("H", [77, 300, 512, 2880])  # sink pieces 1, 4, 16, 4 bytes
def test_one_gpu_fp8_dispatch_matches_cpu(rng, mode, H):
    """A 1-rank group on one GPU (the NCCL transport's path without an exchange: the packed rows of the own
    share expanded by ep_expand_rows' FP8 sinks): dispatch(fp8=True) of a float x and of a uint8 pair, with
    and without dequantize, bitwise equal to the CPU group (the NumPy reference), padding rows zero, the pool
    poisoned underneath; bf16, fp16 and fp32 x."""
    import cupy as cp
    import ml_dtypes

    from moe_rt.reference import fp8 as fref

    E, K, Tmax, T = 9, 3, 40, 37
    kw = {} if mode == "exact" else {"pair_capacity": 30, "capacity": 50}  # some pairs and slots dropped
    g_gpu = EpGroup(None, E, H, Tmax, mode=mode, align_size=4, **kw)
    g_cpu = EpGroup(None, E, H, Tmax, mode=mode, align_size=4, **kw)
    idx = make_routing(rng, T, E, K, "holes")
    w = rng.random((T, K)).astype(np.float32)
    for dt in (ml_dtypes.bfloat16, np.float16, np.float32):
        x = (rng.standard_normal((T, H)) * rng.choice([1e-3, 1.0, 40.0], size=(T, 1))).astype(np.float32).astype(dt)
        q, s = fref.quantize_fp8(np.asarray(x))
        cp.cuda.Device().synchronize()
        poison = cp.full(1 << 22, 0x5A, cp.uint8)  # freed into the pool: later allocations start dirty
        del poison
        h, hc = g_gpu.prepare(cp.asarray(idx)), g_cpu.prepare(idx)
        pair_g, pair_c = (cp.asarray(q.view(np.uint8)), cp.asarray(s)), (q.view(np.uint8), s)
        cq, cs, cw, _ = g_cpu.dispatch(hc, pair_c, w, fp8=True)
        gq, gs, gw, _ = g_gpu.dispatch(h, pair_g, cp.asarray(w), fp8=True)
        assert np.array_equal(gq.get(), cq) and np.array_equal(gs.get(), cs) and np.array_equal(gw.get(), cw)
        if dt != ml_dtypes.bfloat16:  # a float x from CuPy (dequantize=True: CuPy holds no FP8)
            cy, _, _ = g_cpu.dispatch(hc, x, w, fp8=True, dequantize=True)
            gy, _, _ = g_gpu.dispatch(h, cp.asarray(x), cp.asarray(w), fp8=True, dequantize=True)
            assert gy.dtype == cy.dtype and np.array_equal(gy.get().view(np.uint8), cy.view(np.uint8))
        cy, _, _ = g_cpu.dispatch(hc, pair_c, fp8=True, dequantize=True)  # the pair's rows in bfloat16
        gy, _, _ = g_gpu.dispatch(h, pair_g, fp8=True, dequantize=True)
        assert np.array_equal(gy.get().view(np.uint8), np.asarray(cy).view(np.uint8))
        pad = hc.view("src_slot")[:hc.sizes["N"]] < 0
        assert not cq[pad].any() and not cs[pad].any()


def _poison_pool(cp, nbytes, copies=6):
    """Free every unused block of CuPy's pool, then free ``copies`` blocks of ``nbytes`` filled with 0xFF (NaN
    bits in every float dtype) into it: the next allocations of that size start on them."""
    cp.cuda.Device().synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    blocks = [cp.full(max(int(nbytes), 1), 0xFF, cp.uint8) for _ in range(copies)]
    cp.cuda.Device().synchronize()
    del blocks


@pytest.mark.gpu
@pytest.mark.parametrize("mode,align", [("capacity", 1), ("exact", 8)])
def test_one_gpu_backwards_match_cpu(rng, mode, align):
    """A 1-rank group on one GPU: dispatch_bwd and combine_bwd (with y: the slots' dots gathered to the rows
    by the core's moe_rt_ep_gather_slots; without y: the rows weighted; unweighted) bit for bit the CPU group's
    (the NumPy reference), each output written into a pool poisoned with NaN bits first (the sums and dots, whose
    order is the kernels' own, within rounding); bf16, fp16, fp32."""
    import cupy as cp
    import ml_dtypes

    E, K, Tmax, T, H = 9, 3, 40, 37, 200
    kw = {} if mode == "exact" else {"pair_capacity": 30, "capacity": 80}
    g = EpGroup(None, E, H, Tmax, mode=mode, align_size=align, **kw)
    g_cpu = EpGroup(None, E, H, Tmax, mode=mode, align_size=align, **kw)
    idx = make_routing(rng, T, E, K, "holes")
    w = rng.random((T, K)).astype(np.float32)

    def same(a, b):
        a = a.get() if hasattr(a, "get") else a
        assert a.shape == b.shape and np.array_equal(a.view(np.uint8), np.ascontiguousarray(b).view(np.uint8))

    for dt in (ml_dtypes.bfloat16, np.float16, np.float32):
        h, hc = g.prepare(cp.asarray(idx)), g_cpu.prepare(idx)
        x = rng.standard_normal((T, H)).astype(np.float32).astype(dt)
        rx, rw, _ = g.dispatch(h, cp.asarray(x), cp.asarray(w))
        cx, cw, _ = g_cpu.dispatch(hc, x, w)
        y = rng.standard_normal(cx.shape).astype(np.float32).astype(dt)
        gout = rng.standard_normal((T, H)).astype(np.float32).astype(dt)
        yd, gd = cp.asarray(y), cp.asarray(gout)
        _poison_pool(cp, y.nbytes)
        for a, b in zip(g.dispatch_bwd(h, yd, rw), g_cpu.dispatch_bwd(hc, y, cw)):  # fp32 sums: close
            a = a.get().astype(np.float64)
            assert a.shape == b.shape and np.allclose(a, b.astype(np.float64), rtol=1e-2, atol=1e-2)
        _poison_pool(cp, y.nbytes)
        (gy, gw), (cgy, cgw) = g.combine_bwd(h, gd, yd), g_cpu.combine_bwd(hc, gout, y)
        same(gy, cgy)
        # the weights' gradient: fp32 dots over H, summed in another order than NumPy's (as the multi-GPU tests
        # take them: close), and exactly 0 at the rows holding no slot (the gather's zeros)
        gw = gw.get()
        assert gw.shape == cgw.shape and np.allclose(gw, cgw, rtol=1e-5, atol=1e-4)
        empty = hc.view("src_slot")[:hc.sizes["N"]] < 0
        assert empty.any() and (gw[empty] == 0).all() and (cgw[empty] == 0).all()
        _poison_pool(cp, y.nbytes)
        gy, none = g.combine_bwd(h, gd)
        assert none is None
        same(gy, g_cpu.combine_bwd(hc, gout)[0])
        _poison_pool(cp, y.nbytes)
        same(g.combine_bwd(h, gd, weighted=False)[0], g_cpu.combine_bwd(hc, gout, weighted=False)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("mode,align", [("capacity", 1), ("capacity", 4), ("exact", 8)])
def test_one_gpu_zero_empty_slots(rng, mode, align):
    """A 1-rank group on one GPU (the NCCL transport's path without an exchange): dispatch with
    zero_empty_slots=False into a pool poisoned with NaN bits gives the filled rows (src_slot >= 0) bitwise equal
    to the default dispatch and to the CPU group (the NumPy reference), the same weights and
    tokens_per_local_expert, and leaves the empty rows unwritten (some keep the poison); combine and
    dispatch_bwd of those rows (garbage included) are bitwise equal to the default's (they read the filled rows
    only). bf16, fp16, fp32 rows; FP8 codes and scales, and dequantized rows, likewise."""
    import cupy as cp
    import ml_dtypes

    E, K, Tmax, T, H = 9, 3, 40, 37, 200
    # some pairs dropped (pair_capacity); with align 4 some slots too (capacity 50 < the padded rows), with align 1
    # a capacity above the 90 kept slots, so the capacity tail holds no slot
    kw = {} if mode == "exact" else {"pair_capacity": 30, "capacity": 80 if align == 1 else 50}
    g = EpGroup(None, E, H, Tmax, mode=mode, align_size=align, **kw)
    g_cpu = EpGroup(None, E, H, Tmax, mode=mode, align_size=align, **kw)
    idx = make_routing(rng, T, E, K, "holes")
    w = rng.random((T, K)).astype(np.float32)

    def handles():  # a handle binds the token dtype of its first dispatch: one pair of handles per dtype
        return g.prepare(cp.asarray(idx)), g_cpu.prepare(idx)

    h, hc = handles()
    N = h.sizes["N"]
    filled = hc.view("src_slot")[:N] >= 0
    assert (~filled).any()
    for dt in (ml_dtypes.bfloat16, np.float16, np.float32):
        h, hc = handles()
        x = rng.standard_normal((T, H)).astype(np.float32).astype(dt)
        xd, wd = cp.asarray(x), cp.asarray(w)
        rx, rw, tpe = g.dispatch(h, xd, wd)
        cx, cw, ctpe = g_cpu.dispatch(hc, x, w)
        assert np.array_equal(rx.get().view(np.uint8), cx.view(np.uint8))  # the default: zero rows, as ever
        _poison_pool(cp, rx.nbytes)
        nx, nw, ntpe = g.dispatch(h, xd, wd, zero_empty_slots=False)
        b = nx.get().view(np.uint8).reshape(N, -1)
        assert np.array_equal(b[filled], cx.view(np.uint8).reshape(N, -1)[filled])
        assert np.array_equal(nw.get(), cw) and np.array_equal(ntpe.get(), ctpe)
        assert (b[~filled] == 0xFF).all(axis=1).any()  # not written: the poison is still there
        for weighted in (True, False):
            assert np.array_equal(g.combine(h, nx, weighted=weighted).get().view(np.uint8),
                                  g.combine(h, rx, weighted=weighted).get().view(np.uint8))
        for a, b_ in zip(g.dispatch_bwd(h, nx, nw), g.dispatch_bwd(h, rx, rw)):
            assert np.array_equal(a.get().view(np.uint8), b_.get().view(np.uint8))
    # FP8: a uint8 pair -> codes and scales; and dequantized to bf16
    from moe_rt.reference import fp8 as fref

    q, sc = fref.quantize_fp8(rng.standard_normal((T, H)).astype(np.float32))
    pair = (cp.asarray(q.view(np.uint8)), cp.asarray(sc))
    h, hc = handles()
    cq, cs, _, _ = g_cpu.dispatch(hc, (q.view(np.uint8), sc), w, fp8=True)
    gq, gs, _, _ = g.dispatch(h, pair, cp.asarray(w), fp8=True)
    _poison_pool(cp, gq.nbytes)
    nq, ns, _, _ = g.dispatch(h, pair, cp.asarray(w), fp8=True, zero_empty_slots=False)
    assert np.array_equal(nq.get()[filled], cq[filled]) and np.array_equal(ns.get()[filled], cs[filled])
    assert np.array_equal(gq.get(), cq) and np.array_equal(gs.get(), cs)
    assert (nq.get()[~filled] == 0xFF).all(axis=1).any()
    cy, _, _ = g_cpu.dispatch(hc, (q.view(np.uint8), sc), fp8=True, dequantize=True)
    gy, _, _ = g.dispatch(h, pair, fp8=True, dequantize=True)
    _poison_pool(cp, gy.nbytes)
    ny, _, _ = g.dispatch(h, pair, fp8=True, dequantize=True, zero_empty_slots=False)
    cyb = np.asarray(cy).view(np.uint8).reshape(N, -1)
    assert np.array_equal(gy.get().view(np.uint8).reshape(N, -1), cyb)
    nyb = ny.get().view(np.uint8).reshape(N, -1)
    assert np.array_equal(nyb[filled], cyb[filled]) and (nyb[~filled] == 0xFF).all(axis=1).any()
    assert np.array_equal(g.combine(h, ny, weighted=False).get().view(np.uint8),
                          g.combine(h, gy, weighted=False).get().view(np.uint8))


# -- the first call of an op on NCCL waits for its exchanges (kernels load only on an idle device) -------------

class _Stream:
    """A stand-in CuPy stream: an address, and whether it is being captured into a CUDA graph."""

    def __init__(self, ptr, capturing=False):
        self.ptr, self.capturing = ptr, capturing

    def is_capturing(self):
        return self.capturing


def _waiting_group(monkeypatch, events, R=2, transport="nccl"):
    """A group of rank 0 of R on a recording communicator whose host waits are recorded (no CUDA)."""

    class Comm(_RecComm):
        def send(self, ptr, count, dtype, peer, stream):
            events.append(("send", peer))

        def recv(self, ptr, count, dtype, peer, stream):
            events.append(("recv", peer))

        def group_start(self):
            events.append(("group_start",))

        def group_end(self):
            events.append(("group_end",))

    g = EpGroup(Comm(0, R) if R > 1 else None, 4 * R, 8, 16, transport="nccl")
    monkeypatch.setattr(g, "_wait", lambda s, op, timeout=None: events.append(("wait", s.ptr, op)))
    if transport == "mixed":
        from moe_rt import _ep_mixed

        node = type("D", (), {"lo": 0, "hi": 1})()
        g.transport, g._transport = "mixed", _ep_mixed.MixedTransport(node, g._transport)
    elif transport == "direct":
        g.transport, g._transport = "direct", _RecDirect()
    return g


def _exchanging_call(g, events, op, key, s, fail=False):
    """One op call under the group's first-call guard: an NCCL exchange (prepare's box segments to every peer)
    on stream ``s`` (or ``s.ptr + 1``, a second stream), then a launch."""
    with g._first_call(op, key, s):
        nc = g._transport if g.transport == "nccl" else getattr(g._transport, "nccl", None)
        if nc is not None:
            R = g.size
            nc.exchange_box(s, 1 << 20, 2 << 20, [4] * R, [4] * R, 8, 0)
            nc.exchange_box(_Stream(s.ptr + 1), 1 << 20, 2 << 20, [4] * R, [4] * R, 8, 0)
        if fail:
            raise RuntimeError("a failing launch")
        events.append(("launch",))


@pytest.mark.parametrize("transport", ["nccl", "mixed"])
def test_first_call_waits_for_its_exchanges(monkeypatch, transport):
    """A kernel used for the first time loads only once the device is idle, so behind an NCCL kernel waiting for
    a dead peer the host would block before any deadline: the first call of an op kind waits (the group's
    deadline wait, naming the op) for the work queued on its stream, then for each of its exchanges right after
    it is queued (on that exchange's stream), before anything else is launched; a later call of the same kind
    waits for nothing, another kind waits again; a call inside a CUDA-graph capture never waits and leaves the
    kind unsettled, as does a call that raises."""
    events = []
    g = _waiting_group(monkeypatch, events, R=3, transport=transport)
    s = _Stream(100)
    group = ["group_start", "send", "recv", "send", "recv", "group_end"]

    def names():
        out = [e[0] if e[0] != "wait" else ("wait", e[1], e[2]) for e in events]
        events.clear()
        return out

    _exchanging_call(g, events, "dispatch", ("dispatch", "f4"), s)
    assert names() == [("wait", 100, "dispatch")] + group + [("wait", 100, "dispatch")] + group + [
        ("wait", 101, "dispatch"), "launch"]
    _exchanging_call(g, events, "dispatch", ("dispatch", "f4"), s)
    assert names() == group * 2 + ["launch"]
    _exchanging_call(g, events, "combine", ("combine", "f4"), s)
    assert names() == [("wait", 100, "combine")] + group + [("wait", 100, "combine")] + group + [
        ("wait", 101, "combine"), "launch"]
    _exchanging_call(g, events, "combine_bwd", ("combine_bwd", "f2"), _Stream(100, capturing=True))
    assert names() == group * 2 + ["launch"]
    with pytest.raises(RuntimeError, match="failing"):
        _exchanging_call(g, events, "combine_bwd", ("combine_bwd", "f2"), s, fail=True)
    names()
    _exchanging_call(g, events, "combine_bwd", ("combine_bwd", "f2"), s)  # neither call above settled it
    assert names() == [("wait", 100, "combine_bwd")] + group + [("wait", 100, "combine_bwd")] + group + [
        ("wait", 101, "combine_bwd"), "launch"]
    nc = g._transport if transport == "nccl" else g._transport.nccl
    assert nc.settle is None  # nothing waits outside a first call


def test_first_call_timeout_propagates(monkeypatch):
    """The first call's wait after its exchange raises the group's TimeoutError (the peer is dead): the call stops
    there, before launching anything else, and the transport waits for nothing afterwards."""
    events = []
    g = _waiting_group(monkeypatch, events)
    waits = []

    def wait(s, op, timeout=None):
        waits.append(op)
        if len(waits) == 2:
            raise TimeoutError(f"EpGroup.{op}: no progress within 20 s")

    monkeypatch.setattr(g, "_wait", wait)
    with pytest.raises(TimeoutError, match="EpGroup.dispatch"):
        _exchanging_call(g, events, "dispatch", ("dispatch",), _Stream(7))
    assert "launch" not in [e[0] for e in events] and waits == ["dispatch", "dispatch"]
    assert g._transport.settle is None and not g._settled


@pytest.mark.parametrize("transport,R", [("direct", 3), ("nccl", 1)])
def test_first_call_without_nccl_waits_for_nothing(monkeypatch, transport, R):
    """The direct transport's waits end on the device (its barriers time out), and a 1-rank group exchanges
    nothing: their first calls never wait."""
    events = []
    g = _waiting_group(monkeypatch, events, R=R, transport=transport)
    _exchanging_call(g, events, "dispatch", ("dispatch",), _Stream(5))
    assert [e[0] for e in events] == ["launch"]


def test_op_key_tells_apart_what_picks_kernels(monkeypatch):
    """The first-call key of an op: dtype, row width, the rows' address alignment, flags and the NCCL transport's
    overlap choice each make a new key; the same of all is the same key."""
    events = []
    g = _waiting_group(monkeypatch, events)
    h = type("H", (), {"sizes": {"P": 4, "R": 2}, "mode": "capacity"})()
    a = _Dev((5, 8), np.float32)
    base = g._op_key("dispatch", h, a, True)
    assert g._op_key("dispatch", h, _Dev((5, 8), np.float32), True) == base
    others = [g._op_key("combine", h, a, True), g._op_key("dispatch", h, _Dev((5, 8), np.float16), True),
              g._op_key("dispatch", h, _Dev((5, 16), np.float32), True),
              g._op_key("dispatch", h, _Dev((5, 8), np.float32, a.data.ptr + 4), True),
              g._op_key("dispatch", h, a, False)]
    g._transport.overlap = True
    others.append(g._op_key("dispatch", h, a, True))
    assert len({base, *others}) == len(others) + 1
