"""Quantile Balancing (docs/router.md §7): the NumPy reference against a straightforward per-token
implementation of the semantics, TransformerEngine's test cases, the bias update, bad input, the torch / JAX
adapters and moe_rt.te on CPU, and (marker ``gpu``) both CUDA modes against the reference, bitwise against
each other, and under CUDA graph replay with new bounds."""
import math
import re

import numpy as np
import pytest

import moe_rt
import moe_rt.router as R
from moe_rt import _arrays, _jit
from moe_rt.reference import router as ref

F32 = np.float32
BF16 = _arrays.BFLOAT16
MODES = ("fused_atomic", "two_kernel")


# ---- the straightforward implementation ----------------------------------------------------------------

def naive_sigmoid(x):
    return (F32(1) / (F32(1) + np.exp(-np.asarray(x, F32)))).astype(F32)


def naive_qb(raw, bias, K, lower, upper, B, scale=1.0):
    """Per token, from the raw sigmoid values [T, E] fp32: the k + 1 candidates sorted by (biased desc,
    id asc), the cutoff the least biased among them with the larger id on ties, the k others routed with
    probs fl(fl(raw + b) - b) / (sum + 1e-20) * scale; then every expert binned by fp32 steps. Returns
    (probs fp32, map, cutoff, hist int64 [E, B])."""
    raw = np.asarray(raw, F32)
    T, E = raw.shape
    bias = np.asarray(bias, F32)
    lo, hi = F32(lower), F32(upper)
    sc = F32(F32(B) / F32(hi - lo))
    probs = np.zeros((T, E), F32)
    rmap = np.zeros((T, E), bool)
    cut = np.zeros(T, F32)
    hist = np.zeros((E, B), np.int64)
    for t in range(T):
        b = [F32(raw[t, e] + bias[e]) for e in range(E)]
        cand = sorted(range(E), key=lambda e: (-float(b[e]), e))[:K + 1]
        least = min(float(b[e]) for e in cand)
        c = max(e for e in cand if float(b[e]) == least)
        routes = [e for e in cand if e != c]
        cut[t] = b[c]
        vals = {e: F32(b[e] - bias[e]) for e in routes}
        if K > 1:
            den = F32(F32(sum(float(v) for v in vals.values())) + F32(1e-20))
            for e in routes:
                probs[t, e] = F32(F32(scale) * F32(vals[e] / den))
        else:
            for e in routes:
                probs[t, e] = F32(F32(scale) * vals[e])
        rmap[t, routes] = True
        r = (F32(cut[t]) - raw[t]).astype(F32)
        v = ((r - lo).astype(F32) * sc).astype(F32)
        for e in range(E):
            fv = float(v[e])
            j = 0 if math.isnan(fv) else min(max(math.floor(fv), 0), B - 1) if math.isfinite(fv) else (
                B - 1 if fv > 0 else 0)
            hist[e, j] += 1
    return probs, rmap, cut, hist


def te_case(rng, T, E, dtype=F32):
    x = rng.standard_normal((T, E)).astype(dtype)
    bias = np.linspace(-0.2, 0.2, E).astype(F32)
    bounds = np.array([bias.min() - 1, bias.max() + 1], F32)
    return x, bias, bounds


def assert_probs_close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=2e-6, atol=1e-7)


# ---- reference against the straightforward implementation ------------------------------------------------

@pytest.mark.parametrize("K", [8, 16])
@pytest.mark.parametrize("mode", MODES)
def test_te_grid_reference(rng, K, mode):
    T, E, B = 257, 896, 1000
    x, bias, bounds = te_case(rng, T, E)
    start = rng.integers(0, 50, (E, B)).astype(np.int32)  # accumulated onto, never zeroed
    hist = start.copy()
    probs, rmap, inter, cut = R.topk_with_score_qb(x, K, expert_bias=bias, qb_histogram=hist,
                                                   qb_bin_bounds=bounds, qb_histogram_mode=mode)
    raw = naive_sigmoid(x)
    np.testing.assert_array_equal(inter, raw)
    wp, wm, wc, wh = naive_qb(raw, bias, K, bounds[0], bounds[1], B)
    np.testing.assert_array_equal(rmap, wm)
    np.testing.assert_array_equal(cut, wc)
    np.testing.assert_array_equal(hist, start + wh)
    assert_probs_close(probs, wp)
    assert (hist - start).sum(axis=1).tolist() == [T] * E
    # the routes, probs and intermediate of the plain sigmoid + bias forward, bitwise
    p0, m0, i0 = R.topk_with_score(x, K, score_function="sigmoid", expert_bias=bias)
    np.testing.assert_array_equal(probs, p0)
    np.testing.assert_array_equal(rmap, m0)
    np.testing.assert_array_equal(inter, i0)


@pytest.mark.parametrize("T,E,K,B,scale", [(1, 2, 1, 1, None), (13, 7, 6, 5, 2.5), (40, 33, 1, 300, None),
                                           (9, 65, 64, 17, 0.5)])
def test_odd_sizes_reference(rng, T, E, K, B, scale):
    x = rng.standard_normal((T, E)).astype(F32) * 3
    bias = (rng.permutation(E) * (0.4 / E) - 0.2).astype(F32)
    bounds = np.array([-0.7, 1.3], F32)
    hist = np.zeros((E, B), np.int32)
    probs, rmap, inter, cut = R.topk_with_score_qb(x.reshape(1, T, E), K, expert_bias=bias, qb_histogram=hist,
                                                   qb_bin_bounds=bounds, scaling_factor=scale)
    assert probs.shape == (1, T, E) and cut.shape == (1, T)
    wp, wm, wc, wh = naive_qb(inter.reshape(T, E), bias, K, -0.7, 1.3, B, 1.0 if scale is None else scale)
    np.testing.assert_array_equal(rmap.reshape(T, E), wm)
    np.testing.assert_array_equal(cut.reshape(T), wc)
    np.testing.assert_array_equal(hist, wh)
    assert_probs_close(probs.reshape(T, E), wp)


def test_bf16_logits(rng):
    T, E, K, B = 50, 64, 8, 100
    x, bias, bounds = te_case(rng, T, E, BF16)
    hist = np.zeros((E, B), np.int32)
    probs, rmap, inter, cut = R.topk_with_score_qb(x, K, expert_bias=bias, qb_histogram=hist, qb_bin_bounds=bounds)
    assert probs.dtype == BF16 and inter.dtype == F32
    wp, wm, wc, wh = naive_qb(naive_sigmoid(x.astype(F32)), bias, K, bounds[0], bounds[1], B)
    np.testing.assert_array_equal(rmap, wm)
    np.testing.assert_array_equal(cut, wc)
    np.testing.assert_array_equal(hist, wh)
    np.testing.assert_array_equal(probs, wp.astype(BF16))


def test_accumulates_microbatches(rng):
    E, K, B = 64, 8, 1000
    hist = np.zeros((E, B), np.int32)
    want = np.zeros((E, B), np.int64)
    for T in (127, 193):
        x, bias, bounds = te_case(rng, T, E)
        R.topk_with_score_qb(x, K, expert_bias=bias, qb_histogram=hist, qb_bin_bounds=bounds,
                             qb_histogram_mode="two_kernel")
        want += naive_qb(naive_sigmoid(x), bias, K, bounds[0], bounds[1], B)[3]
    np.testing.assert_array_equal(hist, want)
    assert hist.sum() == (127 + 193) * E


TIE_LOGITS = np.array([[3, 3, 3, -1], [5, 4, 3, 2]], F32)
# r = 0 lands in bin floor(0.05f * fl(8 / 0.1f)) = floor(4.0) = 4; row 1: sigmoid(3) - sigmoid(5) -> bin 0,
# sigmoid(3) - sigmoid(4) -> bin 1; sigmoid(3) - sigmoid(2) and row 0's sigmoid(3) - sigmoid(-1) clamp to 7
TIE_HIST = np.array([[1, 0, 0, 0, 1, 0, 0, 0], [0, 1, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 2, 0, 0, 0],
                     [0, 0, 0, 0, 0, 0, 0, 2]], np.int32)


@pytest.mark.parametrize("mode", MODES)
def test_tie_and_bin_clamping(mode):
    hist = np.zeros((4, 8), np.int32)
    bounds = np.array([-0.05, 0.05], F32)
    probs, rmap, inter, cut = R.topk_with_score_qb(TIE_LOGITS, 2, expert_bias=np.zeros(4, F32), qb_histogram=hist,
                                                   qb_bin_bounds=bounds, qb_histogram_mode=mode)
    np.testing.assert_array_equal(rmap, [[True, True, False, False], [True, True, False, False]])
    s3 = naive_sigmoid(F32(3))
    np.testing.assert_array_equal(inter, naive_sigmoid(TIE_LOGITS))
    np.testing.assert_array_equal(cut, [s3, s3])
    np.testing.assert_array_equal(hist, TIE_HIST)
    assert hist[:, 0].sum() > 0 and hist[:, -1].sum() > 0


def test_nan_and_out_of_range_bins():
    # a NaN logit is selected first and gives a NaN r for its expert (bin 0); huge bounds shift -> edge bins
    x = np.array([[np.nan, 0.0, 1.0, -1.0]], F32)
    hist = np.zeros((4, 3), np.int32)
    _, rmap, _, cut = R.topk_with_score_qb(x, 1, expert_bias=np.zeros(4, F32), qb_histogram=hist,
                                           qb_bin_bounds=np.array([10.0, 11.0], F32))
    assert rmap[0, 0] and rmap.sum() == 1
    assert cut[0] == naive_sigmoid(F32(1.0))
    np.testing.assert_array_equal(hist, [[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]])  # NaN -> 0; r < lower -> 0
    hist[:] = 0
    R.topk_with_score_qb(x, 1, expert_bias=np.zeros(4, F32), qb_histogram=hist,
                         qb_bin_bounds=np.array([-11.0, -10.0], F32))
    np.testing.assert_array_equal(hist[:, 2], [0, 1, 1, 1])  # above upper -> the last bin
    assert hist[0, 0] == 1


def test_histogram_accumulate_alone(rng):
    T, E, B = 21, 10, 7
    raw = rng.random((3, T, E)).astype(F32)
    cut = rng.random((3, T)).astype(F32)
    bounds = np.array([-0.5, 0.5], F32)
    hist = np.zeros((E, B), np.int32)
    R.qb_histogram_accumulate(raw, cut, bounds, hist)
    want = np.zeros((E, B), np.int64)
    for t in range(3 * T):
        r = (cut.reshape(-1)[t] - raw.reshape(-1, E)[t]).astype(F32)
        v = ((r - bounds[0]).astype(F32) * F32(F32(B) / F32(bounds[1] - bounds[0]))).astype(F32)
        for e in range(E):
            want[e, min(max(math.floor(float(v[e])), 0), B - 1)] += 1
    np.testing.assert_array_equal(hist, want)


def test_torch_cpu_in_place_and_grads(rng):
    torch = pytest.importorskip("torch")
    import moe_rt.torch as mt

    T, E, K, B = 37, 48, 6, 64
    x, bias, bounds = te_case(rng, T, E)
    xt = torch.tensor(x, requires_grad=True)
    hist = torch.zeros(E, B, dtype=torch.int32)
    probs, rmap = mt.topk_with_score_qb(xt, K, expert_bias=torch.tensor(bias), qb_histogram=hist,
                                        qb_bin_bounds=torch.tensor(bounds), scaling_factor=1.5)
    wp, wm, _, wh = naive_qb(naive_sigmoid(x), bias, K, bounds[0], bounds[1], B, 1.5)
    np.testing.assert_array_equal(hist.numpy(), wh)
    np.testing.assert_array_equal(rmap.numpy(), wm)
    assert_probs_close(probs.detach().numpy(), wp)
    g = torch.randn(T, E, dtype=torch.float64)
    (gx,) = torch.autograd.grad(probs, xt, g.float())
    # plain torch in float64 over the same routes: the sigmoid backward over the k routes
    xd = xt.detach().double().requires_grad_(True)
    s = torch.sigmoid(xd) * torch.tensor(wm)
    p = 1.5 * s / (s.sum(-1, keepdim=True) + 1e-20)
    (gd,) = torch.autograd.grad(p, xd, g)
    np.testing.assert_allclose(gx.numpy(), gd.numpy(), rtol=1e-5, atol=1e-5)
    assert (gx.numpy()[~wm] == 0).all()


def test_torch_compile_cpu(rng):
    torch = pytest.importorskip("torch")
    import moe_rt.torch as mt

    T, E, K, B = 19, 24, 3, 16
    x, bias, bounds = te_case(rng, T, E)
    bt, dt = torch.tensor(bias), torch.tensor(bounds)
    g = torch.randn(T, E)

    def f(x, hist):
        probs, _ = mt.topk_with_score_qb(x, K, expert_bias=bt, qb_histogram=hist, qb_bin_bounds=dt,
                                         qb_histogram_mode="two_kernel")
        return (probs * g).sum()

    h1, h2 = torch.zeros(E, B, dtype=torch.int32), torch.zeros(E, B, dtype=torch.int32)
    xe = torch.tensor(x, requires_grad=True)
    (ge,) = torch.autograd.grad(f(xe, h1), xe)
    xc = torch.tensor(x, requires_grad=True)
    (gc,) = torch.autograd.grad(torch.compile(f, fullgraph=True)(xc, h2), xc)
    assert torch.equal(ge, gc) and torch.equal(h1, h2) and int(h1.sum()) == T * E


def test_jax_functional_and_grads(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import moe_rt.jax as mj

    T, E, K, B = 29, 40, 4, 50
    x, bias, bounds = te_case(rng, T, E)
    h0 = rng.integers(0, 9, (E, B)).astype(np.int32)
    f = jax.jit(lambda x, h: mj.topk_with_score_qb(x, K, expert_bias=jnp.asarray(bias), qb_histogram=h,
                                                   qb_bin_bounds=jnp.asarray(bounds), qb_histogram_mode="two_kernel"))
    probs, rmap, h1 = f(jnp.asarray(x), jnp.asarray(h0))
    wp, wm, _, wh = naive_qb(naive_sigmoid(x), bias, K, bounds[0], bounds[1], B)
    np.testing.assert_array_equal(np.asarray(h1), h0 + wh)
    np.testing.assert_array_equal(np.asarray(rmap), wm)
    assert_probs_close(np.asarray(probs), wp)

    def loss(fn):
        return lambda x: (fn(x)[0] ** 2).sum()

    g = jax.grad(loss(lambda x: mj.topk_with_score_qb(x, K, expert_bias=jnp.asarray(bias),
                                                      qb_histogram=jnp.asarray(h0), qb_bin_bounds=jnp.asarray(bounds))))
    g0 = jax.grad(loss(lambda x: mj.topk_with_score(x, K, score_function="sigmoid", expert_bias=jnp.asarray(bias))))
    np.testing.assert_array_equal(np.asarray(g(jnp.asarray(x))), np.asarray(g0(jnp.asarray(x))))
    with pytest.raises(ValueError, match="lower < upper"):
        mj.topk_with_score_qb(jnp.asarray(x), K, expert_bias=jnp.asarray(bias), qb_histogram=jnp.asarray(h0),
                              qb_bin_bounds=jnp.asarray([1.0, 1.0], jnp.float32))


# ---- moe_rt.te -----------------------------------------------------------------------------------------

def test_te_qb_cpu(rng):
    torch = pytest.importorskip("torch")
    from moe_rt import te

    T, E, K, B = 31, 40, 4, 32
    x, bias, bounds = te_case(rng, T, E)
    hist = torch.zeros(E, B, dtype=torch.int32)
    d = torch.tensor(bounds)
    xt = torch.tensor(x, requires_grad=True)
    for mode in MODES:
        probs, rmap = te.fused_topk_with_score_function(xt, K, True, None, None, 2.0, "sigmoid", torch.tensor(bias),
                                                        qb_histogram=hist, qb_bin_bounds=d, qb_histogram_mode=mode)
        wp, wm, _, _ = naive_qb(naive_sigmoid(x), bias, K, bounds[0], bounds[1], B, 2.0)  # pre-softmax ignored
        np.testing.assert_array_equal(rmap.numpy(), wm)
        assert_probs_close(probs.detach().numpy(), wp)
    wh = naive_qb(naive_sigmoid(x), bias, K, bounds[0], bounds[1], B)[3]
    np.testing.assert_array_equal(hist.numpy(), 2 * wh)
    assert te._qb_checked.get(d) == d._version  # checked once for this version
    d.fill_(float("nan"))  # a tracked write: checked again
    with pytest.raises(ValueError, match="finite with lower < upper"):
        te.fused_topk_with_score_function(xt, K, False, None, None, None, "sigmoid", torch.tensor(bias),
                                          qb_histogram=hist, qb_bin_bounds=d, qb_histogram_mode="fused_atomic")


@pytest.mark.parametrize("out", ["bitmap_u8", "int16", "int64"])
def test_te_qb_routing_outputs_cpu(rng, out):
    """moe_rt.te's Quantile Balancing with TE's other routing outputs: the bit-packed map (LSB first, E = 43
    pads 5 bits) and the dense indices (ascending expert id) written into the caller's buffer, both equal to
    the bool map's; probs and their gradient unchanged."""
    torch = pytest.importorskip("torch")
    from moe_rt import te

    T, E, K, B = 29, 43, 5, 16
    x, bias, bounds = te_case(rng, T, E)
    xt = torch.tensor(x, requires_grad=True)
    args = (K, False, None, None, None, "sigmoid", torch.tensor(bias))
    kw = dict(qb_bin_bounds=torch.tensor(bounds), qb_histogram_mode="fused_atomic")
    p0, m0 = te.fused_topk_with_score_function(xt, *args, qb_histogram=torch.zeros(E, B, dtype=torch.int32), **kw)
    g0, = torch.autograd.grad(p0.square().sum(), xt)
    hist = torch.zeros(E, B, dtype=torch.int32)
    if out == "bitmap_u8":
        p1, r1 = te.fused_topk_with_score_function(xt, *args, routing_map_format=out, qb_histogram=hist, **kw)
        assert r1.dtype == torch.uint8 and r1.shape == (T, 6)
        np.testing.assert_array_equal(r1.numpy(), np.packbits(m0.numpy(), axis=-1, bitorder="little"))
    else:
        buf = torch.full((T, K), -7, dtype=getattr(torch, out))
        p1, r1 = te.fused_topk_with_score_function(xt, *args, topk_indices=buf, qb_histogram=hist, **kw)
        assert r1 is buf
        want = np.sort(np.argsort(~m0.numpy(), axis=1, kind="stable")[:, :K], axis=1)
        np.testing.assert_array_equal(buf.numpy(), want)
        with pytest.raises(ValueError, match="topk_indices"):
            te.fused_topk_with_score_function(xt, *args, topk_indices=torch.empty(T, K + 1, dtype=buf.dtype),
                                              qb_histogram=hist, **kw)
    g1, = torch.autograd.grad(p1.square().sum(), xt)
    assert torch.equal(p0, p1) and torch.equal(g0, g1)


def test_te_qb_bad_input():
    torch = pytest.importorskip("torch")
    from moe_rt import te

    x = torch.randn(8, 16)
    bias = torch.zeros(16)
    hist, bounds = torch.zeros(16, 10, dtype=torch.int32), torch.tensor([-1.0, 1.0])

    def call(**kw):
        a = dict(topk=2, score="sigmoid", bias=bias, groups=(None, None))
        a.update(kw)
        qb = dict(qb_histogram=hist, qb_bin_bounds=bounds, qb_histogram_mode="fused_atomic")
        qb.update(a.pop("qb", {}))
        return te.fused_topk_with_score_function(x, a["topk"], False, *a["groups"], None, a["score"], a["bias"], **qb)

    with pytest.raises(ValueError, match="together"):
        call(qb=dict(qb_bin_bounds=None))
    with pytest.raises(ValueError, match="together"):
        call(qb=dict(qb_histogram_mode=None))
    with pytest.raises(ValueError, match="sigmoid"):
        call(score="softmax", bias=None)
    with pytest.raises(ValueError, match="sigmoid"):
        call(score="sqrtsoftplus")
    with pytest.raises(ValueError, match="expert_bias"):
        call(bias=None)
    with pytest.raises(ValueError, match="grouped"):
        call(groups=(4, 2))
    with pytest.raises(ValueError, match="two_kernel"):
        call(qb=dict(qb_histogram_mode="atomic"))
    for bad in ([1.0, 1.0], [1.0, -1.0], [float("nan"), 1.0], [-float("inf"), 1.0]):
        with pytest.raises(ValueError, match="finite with lower < upper"):
            call(qb=dict(qb_bin_bounds=torch.tensor(bad)))
    with pytest.raises(TypeError, match="qb_bin_bounds"):
        call(qb=dict(qb_bin_bounds=bounds.double()))
    with pytest.raises(ValueError, match="qb_bin_bounds"):
        call(qb=dict(qb_bin_bounds=torch.tensor([-1.0, 0.0, 1.0])))
    with pytest.raises(TypeError, match="qb_histogram"):
        call(qb=dict(qb_histogram=hist.long()))
    with pytest.raises(ValueError, match="qb_histogram"):
        call(qb=dict(qb_histogram=torch.zeros(15, 10, dtype=torch.int32)))
    with pytest.raises(ValueError, match="topk"):
        call(topk=16)
    assert int(hist.sum()) == 0  # nothing was counted by the failed calls


# ---- core op bad input -----------------------------------------------------------------------------------

def _qb_kwargs(E=16, B=10, **kw):
    a = dict(expert_bias=np.zeros(E, F32), qb_histogram=np.zeros((E, B), np.int32),
             qb_bin_bounds=np.array([-1, 1], F32))
    a.update(kw)
    return a


@pytest.mark.parametrize("kw,exc,match", [
    (dict(expert_bias=None), TypeError, "expert_bias"),
    (dict(num_groups=4, group_topk=2), ValueError, "group"),
    (dict(score_function="softmax"), ValueError, "sigmoid"),
    (dict(score_function="relu"), ValueError, "score_function"),
    (dict(qb_bin_bounds=np.array([1, 1], F32)), ValueError, "lower < upper"),
    (dict(qb_bin_bounds=np.array([1, -1], F32)), ValueError, "lower < upper"),
    (dict(qb_bin_bounds=np.array([np.nan, 1], F32)), ValueError, "finite"),
    (dict(qb_bin_bounds=np.array([0, np.inf], F32)), ValueError, "finite"),
    (dict(qb_bin_bounds=np.array([-1, 1], np.float64)), TypeError, "qb_bin_bounds"),
    (dict(qb_bin_bounds=np.array([-1, 0, 1], F32)), ValueError, "qb_bin_bounds"),
    (dict(qb_bin_bounds=None), TypeError, "qb_bin_bounds"),
    (dict(qb_histogram=None), TypeError, "qb_histogram"),
    (dict(qb_histogram=np.zeros((16, 10), np.int64)), TypeError, "qb_histogram"),
    (dict(qb_histogram=np.zeros((16, 10), F32)), TypeError, "qb_histogram"),
    (dict(qb_histogram=np.zeros((15, 10), np.int32)), ValueError, "qb_histogram"),
    (dict(qb_histogram=np.zeros((16, 0), np.int32)), ValueError, "qb_histogram"),
    (dict(qb_histogram=np.zeros((16,), np.int32)), ValueError, "qb_histogram"),
    (dict(qb_histogram=np.zeros((10, 16), np.int32).T), ValueError, "contiguous"),
    (dict(qb_histogram_mode="atomic"), ValueError, "qb_histogram_mode"),
    (dict(qb_histogram_mode=1), TypeError, "qb_histogram_mode"),
    (dict(expert_bias=np.zeros(15, F32)), ValueError, "expert_bias"),
    (dict(bounds_validated=1), TypeError, "bounds_validated"),
    (dict(scaling_factor=float("inf")), ValueError, "scaling_factor"),
])
def test_bad_input(kw, exc, match):
    x = np.zeros((8, 16), F32)
    a = _qb_kwargs(**kw)
    with pytest.raises(exc, match=match):
        R.topk_with_score_qb(x, 2, **a)
    if a["qb_histogram"] is not None and a["qb_histogram"].dtype == np.int32:
        assert a["qb_histogram"].sum() == 0


def test_bad_topk_and_readonly():
    x = np.zeros((8, 16), F32)
    with pytest.raises(ValueError, match="topk"):
        R.topk_with_score_qb(x, 16, **_qb_kwargs())
    with pytest.raises(ValueError, match="topk"):
        R.topk_with_score_qb(x, 0, **_qb_kwargs())
    with pytest.raises(TypeError, match="topk"):
        R.topk_with_score_qb(x, 2.0, **_qb_kwargs())
    ro = np.zeros((16, 10), np.int32)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        R.topk_with_score_qb(x, 2, **_qb_kwargs(qb_histogram=ro))
    with pytest.raises(ValueError, match="cutoff"):
        R.qb_histogram_accumulate(np.zeros((4, 16), F32), np.zeros(3, F32), np.array([-1, 1], F32),
                                  np.zeros((16, 10), np.int32))
    with pytest.raises(ValueError, match="lower < upper"):
        R.qb_histogram_accumulate(np.zeros((4, 16), F32), np.zeros(4, F32), np.array([1, -1], F32),
                                  np.zeros((16, 10), np.int32))


# ---- the bias update -------------------------------------------------------------------------------------

def test_bias_update_documented_case():
    hist = np.array([[0, 2, 2, 0], [2, 2, 0, 0]], np.int32)
    bounds = np.array([-1, 1], F32)
    bias = np.zeros(2, F32)
    moe_rt.update_expert_bias_with_quantile(hist, bounds, bias, 1)
    np.testing.assert_array_equal(bias, [0.25, -0.25])
    np.testing.assert_array_equal(bounds, [-1.25, 1.25])
    assert not hist.any()


def naive_bias_update(hist, bounds, bias, k):
    E, B = hist.shape
    N = int(hist[0].sum())
    if N == 0:
        return bias.astype(np.float64), bounds.astype(np.float64)
    target = N * k / E
    rank = max(1, math.ceil(target))
    lo, hi = float(bounds[0]), float(bounds[1])
    b = []
    for e in range(E):
        c = np.cumsum(hist[e].astype(np.int64))
        hits = np.nonzero(c >= rank)[0]
        j = int(hits[0]) if len(hits) else B - 1
        before = int(c[j - 1]) if j > 0 else 0
        frac = min(max((target - before) / max(int(hist[e, j]), 1), 0.0), 1.0)
        b.append(lo + ((j + frac) * (hi - lo)) / B)
    b = np.array(b) - np.mean(b)
    return b, np.array([b.min() - 1, b.max() + 1])


def test_bias_update_layers_and_empty(rng):
    torch = pytest.importorskip("torch")
    L, E, B, K = 3, 12, 20, 3
    hist = torch.tensor(rng.integers(0, 3, (L, E, B)).astype(np.int32))
    hist[..., -1] += 60 - hist.sum(-1)  # every row counts the same 60 tokens, as the op makes them (sums <= 40)
    hist[1] = 0  # no tokens: bias and bounds kept
    bounds = torch.tensor([[-1.0, 1.0], [-0.5, 2.0], [-2.0, 0.5]])
    bias = torch.tensor(rng.standard_normal((L, E)).astype(F32))
    h0, d0, b0 = hist.numpy().copy(), bounds.numpy().copy(), bias.numpy().copy()
    ptrs = (hist.data_ptr(), bounds.data_ptr(), bias.data_ptr())
    moe_rt.update_expert_bias_with_quantile(hist, bounds, bias, K)
    assert (hist.data_ptr(), bounds.data_ptr(), bias.data_ptr()) == ptrs and int(hist.abs().sum()) == 0
    for layer in range(L):
        wb, wd = naive_bias_update(h0[layer], d0[layer], b0[layer], K)
        np.testing.assert_array_equal(bias[layer].numpy(), wb.astype(F32))
        np.testing.assert_array_equal(bounds[layer].numpy(), wd.astype(F32))
    np.testing.assert_array_equal(bias[1].numpy(), b0[1])


def test_bias_update_bad_input():
    h, d, b = np.zeros((4, 8), np.int32), np.array([-1, 1], F32), np.zeros(4, F32)
    with pytest.raises(TypeError, match="qb_histogram"):
        moe_rt.update_expert_bias_with_quantile(h.astype(np.int64), d, b, 1)
    with pytest.raises(ValueError, match="qb_bin_bounds"):
        moe_rt.update_expert_bias_with_quantile(h, np.zeros(3, F32), b, 1)
    with pytest.raises(ValueError, match="expert_bias"):
        moe_rt.update_expert_bias_with_quantile(h, d, np.zeros(5, F32), 1)
    with pytest.raises(ValueError, match="topk"):
        moe_rt.update_expert_bias_with_quantile(h, d, b, 4)
    with pytest.raises(TypeError, match="expert_bias"):
        moe_rt.update_expert_bias_with_quantile(h, d, b.astype(BF16), 1)
    with pytest.raises(ValueError, match="contiguous"):
        moe_rt.update_expert_bias_with_quantile(np.zeros((8, 4), np.int32).T, d, b, 1)


# ---- GPU ---------------------------------------------------------------------------------------------------

def _from_raw(raw, bias, K):
    """The routes and cutoff the semantics give for the device's own raw sigmoid values."""
    r = (raw + bias[None, :]).astype(F32)
    order = np.argsort(~ref.float_keys(r), axis=-1, kind="stable")
    sel = np.zeros(raw.shape, bool)
    np.put_along_axis(sel, order[:, :K], True, axis=-1)
    return sel, np.take_along_axis(r, order[:, K:K + 1], axis=-1)[:, 0]


def _hist_of(raw, cut, bounds, B):
    h = np.zeros((raw.shape[1], B), np.int32)
    ref.qb_histogram_accumulate(raw, cut, bounds, h)
    return h


# (T, E, K, B, dtype): TE's grid, odd sizes, each team width (32, 128 and 512 threads a token), k = 64
GPU_CASES = [(257, 896, 8, 1000, F32), (257, 896, 16, 1000, F32), (257, 896, 16, 1000, BF16),
             (1, 2, 1, 1, F32), (33, 7, 6, 5, np.float16), (4099, 256, 8, 4000, BF16), (129, 2304, 36, 333, F32),
             (65, 3000, 64, 8000, BF16), (7, 16384, 17, 64, F32), (300, 100, 64, 100, F32)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-K{c[2]}-B{c[3]}-{np.dtype(c[4]).name}")
def test_gpu_modes_vs_reference(rng, case):
    import cupy as cp

    T, E, K, B, dtype = case
    x, bias, bounds = te_case(rng, T, E, dtype)
    start = rng.integers(0, 1000, (E, B)).astype(np.int32)
    outs = {}
    for mode in MODES:
        hist = cp.asarray(start)
        p, m, i, c = R.topk_with_score_qb(cp.asarray(x), K, expert_bias=cp.asarray(bias), qb_histogram=hist,
                                          qb_bin_bounds=cp.asarray(bounds), qb_histogram_mode=mode)
        outs[mode] = [a.get() for a in (p, m, i, c, hist)]
    for a, b in zip(outs["fused_atomic"], outs["two_kernel"]):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))  # bitwise, NaN included
    probs, rmap, raw, cut, hist = outs["fused_atomic"]
    # exact against the semantics applied to the device's own raw values
    sel, wcut = _from_raw(raw, bias, K)
    np.testing.assert_array_equal(rmap, sel)
    np.testing.assert_array_equal(cut, wcut)
    np.testing.assert_array_equal(hist, start + _hist_of(raw, cut, bounds, B))
    # the plain sigmoid + bias forward's outputs, bitwise (the kernels share the sigmoid and the weights)
    p0, m0, i0 = R.topk_with_score(cp.asarray(x), K, score_function="sigmoid", expert_bias=cp.asarray(bias))
    np.testing.assert_array_equal(rmap, m0.get())
    np.testing.assert_array_equal(probs.view(np.uint8), p0.get().view(np.uint8))
    np.testing.assert_array_equal(raw, i0.get())
    # the raw values and probs within the router's fp32 tolerance of the CPU reference
    rp, rm, ri, rc = ref.topk_with_score_qb_fwd(x, K, bias)
    tol = max(1e-5, 4e-7 * E)
    np.testing.assert_allclose(raw, ri, rtol=tol, atol=tol)
    ok = (rmap == rm).all(1)
    assert ok.sum() >= T - max(1, T // 100)
    rtol = {F32: tol, np.float16: 2 ** -10, BF16: 2 ** -7}[dtype]
    np.testing.assert_allclose(probs[ok].astype(np.float64), rp[ok].astype(np.float64), rtol=rtol, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_tie_and_bin_clamping(mode):
    import cupy as cp

    hist = cp.zeros((4, 8), cp.int32)
    p, m, i, c = R.topk_with_score_qb(cp.asarray(TIE_LOGITS), 2, expert_bias=cp.zeros(4, cp.float32),
                                      qb_histogram=hist, qb_bin_bounds=cp.asarray([-0.05, 0.05], cp.float32),
                                      qb_histogram_mode=mode)
    np.testing.assert_array_equal(m.get(), [[True, True, False, False], [True, True, False, False]])
    np.testing.assert_array_equal(hist.get(), TIE_HIST)
    assert c.get()[0] == c.get()[1] == i.get()[0, 0]


# (T, E, B, offset in floats of raw's first element, the kernel the plan takes)
HIST_ALONE_CASES = [(3000, 37, 9000, 0, 1),  # 32 B int32 above the shared memory: straight global atomics
                    (3000, 37, 50, 0, 1), (3001, 40, 50, 0, 4), (3001, 40, 50, 1, 1),  # E % 4; raw misaligned
                    (777, 2304, 64, 0, 4), (3000, 40, 455, 0, 1), (2999, 44, 9000, 0, 1), (5, 8, 3, 0, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", HIST_ALONE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_histogram_accumulate_alone(rng, monkeypatch, case):
    import cupy as cp

    T, E, B, off, vpl = case
    names = []
    function = _jit.function
    monkeypatch.setattr(_jit, "function", lambda f, n: names.append(n) or function(f, n))
    raw = rng.random((T, E)).astype(F32)
    cut = rng.random(T).astype(F32)
    bounds = np.array([-0.5, 0.5], F32)
    flat = cp.full(T * E + off, np.nan, cp.float32)
    draw = flat[off:].reshape(T, E)
    draw[...] = cp.asarray(raw)
    start = rng.integers(0, 100, (E, B)).astype(np.int32)
    hist = cp.asarray(start)
    R.qb_histogram_accumulate(draw, cp.asarray(cut), cp.asarray(bounds), hist)
    assert names == [f"qb_histogram_accumulate<{vpl}>"]
    np.testing.assert_array_equal(hist.get(), start + _hist_of(raw, cut, bounds, B))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_torch_graph_replay_with_new_bounds(rng, mode):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from moe_rt import te

    T, E, K, B = 257, 896, 8, 1000
    x, bias, bounds = te_case(rng, T, E)
    xt, bt, dt = torch.tensor(x).cuda(), torch.tensor(bias).cuda(), torch.tensor(bounds).cuda()
    hist = torch.zeros(E, B, dtype=torch.int32, device="cuda")

    def route():
        return te.fused_topk_with_score_function(xt, K, False, None, None, None, "sigmoid", bt, qb_histogram=hist,
                                                 qb_bin_bounds=dt, qb_histogram_mode=mode)

    fresh = torch.tensor(bounds).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with pytest.raises(RuntimeError, match="validated by an eager router call"):
            g0 = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g0, stream=s):
                te.fused_topk_with_score_function(xt, K, False, None, None, None, "sigmoid", bt, qb_histogram=hist,
                                                  qb_bin_bounds=fresh, qb_histogram_mode=mode)
    torch.cuda.synchronize()
    route()  # eager: checks the bounds (and compiles the kernels) before capture
    torch.cuda.synchronize()
    hist.zero_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        probs, rmap = route()
    hist.zero_()
    new = np.array([-0.3, 0.9], F32)
    dt.copy_(torch.tensor(new))  # a new value in the same allocation: the replay reads it
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    p1, m1, i1, c1 = R.topk_with_score_qb(xt, K, expert_bias=bt, qb_histogram=torch.zeros_like(hist),
                                          qb_bin_bounds=dt)
    h1 = _hist_of(i1.cpu().numpy(), c1.cpu().numpy(), new, B)
    np.testing.assert_array_equal(hist.cpu().numpy(), 2 * h1)
    assert torch.equal(rmap, m1) and torch.equal(probs, p1)


@pytest.mark.gpu
def test_gpu_torch_grads(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    import moe_rt.torch as mt

    T, E, K, B = 257, 896, 16, 1000
    x, bias, bounds = te_case(rng, T, E)
    xt = torch.tensor(x, device="cuda", requires_grad=True)
    hist = torch.zeros(E, B, dtype=torch.int32, device="cuda")
    probs, rmap = mt.topk_with_score_qb(xt, K, expert_bias=torch.tensor(bias).cuda(), qb_histogram=hist,
                                        qb_bin_bounds=torch.tensor(bounds).cuda())
    g = torch.randn(T, E, device="cuda")
    (gx,) = torch.autograd.grad(probs, xt, g)
    xd = xt.detach().double().requires_grad_(True)
    s = torch.sigmoid(xd) * rmap
    (gd,) = torch.autograd.grad(s / (s.sum(-1, keepdim=True) + 1e-20), xd, g.double())
    torch.testing.assert_close(gx.double(), gd, rtol=1e-5, atol=1e-5)
    assert int(hist.sum()) == T * E


@pytest.mark.gpu
def test_gpu_bias_update(rng):
    import cupy as cp

    L, E, B, K = 2, 64, 1000, 8
    hist = np.zeros((L, E, B), np.int32)
    for layer in range(L):  # histograms the op made: every row counts the same tokens
        x, bias, bounds = te_case(rng, 300, E)
        R.topk_with_score_qb(x, K, expert_bias=bias, qb_histogram=hist[layer], qb_bin_bounds=bounds)
    bounds = np.array([[-1.2, 1.2], [-0.7, 1.5]], F32)
    bias = rng.standard_normal((L, E)).astype(F32)
    hg, dg, bg = cp.asarray(hist), cp.asarray(bounds), cp.asarray(bias)
    ptrs = (hg.data.ptr, dg.data.ptr, bg.data.ptr)
    moe_rt.update_expert_bias_with_quantile(hg, dg, bg, K)
    moe_rt.update_expert_bias_with_quantile(hist, bounds, bias, K)
    assert (hg.data.ptr, dg.data.ptr, bg.data.ptr) == ptrs and not hg.any()
    np.testing.assert_allclose(bg.get(), bias, rtol=0, atol=1e-6)  # float64 means summed in other orders
    np.testing.assert_allclose(dg.get(), bounds, rtol=0, atol=1e-6)


# ---- the forward kernels' paths (kernels/router.cu "Quantile Balancing") ------------------------------------

def test_forward_kernel_choice():
    """router_fwd_qb_reg where the plain forward takes router_fwd_reg (16-byte float32/bfloat16 rows up to
    E = 1024), router_fwd_qb otherwise; the shared-memory histogram (hmode 2) where E ceil(B / 2) words fit
    _QB_SMEM_HIST_BYTES (router_fwd_qb_reg: one block of every warp it takes a multiprocessor, sized at
    launch), else global atomics (1) up to _QB_ATOMIC_SAMPLES samples T E, else none (0: the histogram by
    qb_histogram_accumulate after the kernel, as in the two-kernel mode, which is always 0); every name
    registered."""
    names = _jit.REGISTRY["router.cu"]
    T = 65536
    cases = [((F32, T, 256, 8, 64, True, True), ("router_fwd_qb_reg<float, 8>", 2)),
             ((BF16, T, 256, 8, 64, True, True), ("router_fwd_qb_reg<__nv_bfloat16, 8>", 2)),
             ((F32, T, 512, 16, 48, True, True), ("router_fwd_qb_reg<float, 16>", 2)),
             ((F32, T, 512, 16, 49, True, True), ("router_fwd_qb_reg<float, 16>", 0)),
             ((F32, 512, 512, 16, 49, True, True), ("router_fwd_qb_reg<float, 16>", 1)),
             ((F32, T, 1024, 8, 64, True, True), ("router_fwd_qb_reg<float, 32>", 0)),
             ((BF16, T, 1024, 8, 4000, True, False), ("router_fwd_qb_reg<__nv_bfloat16, 32>", 0)),
             ((F32, T, 256, 8, 64, False, True), ("router_fwd_qb<float, 32>", 2)),
             ((F32, T, 256, 8, 64, False, False), ("router_fwd_qb<float, 32, false>", 0)),
             ((np.float16, T, 256, 8, 64, True, True), ("router_fwd_qb<__half, 32>", 2)),
             ((F32, T, 2304, 36, 64, True, True), ("router_fwd_qb<float, 32, false>", 0)),
             ((F32, 113, 2304, 36, 64, True, True), ("router_fwd_qb<float, 32>", 1)),
             ((BF16, T, 3000, 64, 5, True, True), ("router_fwd_qb<__nv_bfloat16, 128>", 2)),
             ((F32, 16, 16384, 17, 64, True, True), ("router_fwd_qb<float, 512>", 1)),
             ((F32, 17, 16384, 17, 64, True, True), ("router_fwd_qb<float, 512, false>", 0))]
    for (dt, n, E, K, B, vec, fused), (name, hmode) in cases:
        got = R._qb_fwd_cfg(np.dtype(dt), n, E, K, B, vec, fused)
        assert (got[0], got[5]) == (name, hmode), (dt, n, E, K, B, vec, fused, got)
        assert got[0] in names
        hbytes = 4 * E * ((B + 1) // 2) if hmode == 2 else 0
        if got[0].startswith("router_fwd_qb_reg"):
            if hmode == 2:
                assert got[1:5] == (None, None, hbytes, 0)
            else:
                assert got[1:4] == (128, 4, 16 * (2 * 64 + 4 + 4 * ((K + 3) & ~3)))
        else:
            team = R._team(E, fwd=True)
            spb = 4 if team == 32 else 1
            assert got[1:4] == (team * spb, spb, 4 * spb * R._slot_words(E, 0, K + 1, team) + hbytes)
    old = R._QB_SMEM_HIST_BYTES
    try:
        R._QB_SMEM_HIST_BYTES = 0
        assert R._qb_hmode(8, 8, 1, True) == 1 and R._qb_hmode(8, 8, 1, False) == 0
        assert R._qb_hmode(1 << 15, 8, 1, True) == 1 and R._qb_hmode((1 << 15) + 1, 8, 1, True) == 0
    finally:
        R._QB_SMEM_HIST_BYTES = old
    assert R._qb_hmode(65536, 256, 64, True) == 2 and R._qb_hmode(65536, 256, 97, True) == 0
    assert R._qb_hmode(1000, 256, 97, True) == 1 and R._qb_hmode(1000, 256, 64, False) == 0


def test_histogram_kernel_grid(monkeypatch):
    """qb_histogram_accumulate<VPL>: strips of 32 VPL experts (VPL = 4, 1024 threads, where raw's rows take
    16-byte loads and the strip's 128 B int32 counters fit a block; else VPL = 1, 256 threads), token shares
    filling one resident wave with them (each of at least max(256, 4 B) tokens), the strip's counters in
    shared memory when they fit."""
    props = {"sm_count": 132, "smem_per_block_optin": 227 * 1024, "smem_per_sm": 228 * 1024}
    monkeypatch.setattr(_jit, "device_properties", lambda dev: props)
    four, one = "qb_histogram_accumulate<4>", "qb_histogram_accumulate<1>"
    # VPL = 4 at 52 registers: one block of 1024 threads a multiprocessor, 132 resident
    assert R._qb_hist_cfg(65536, 256, 64, True, 0, 52) == (four, (2, 66), 1024, 4 * 128 * 64, True)
    assert R._qb_hist_cfg(65536, 2304, 64, True, 0, 52) == (four, (18, 7), 1024, 4 * 128 * 64, True)
    assert R._qb_hist_cfg(65536, 16384, 64, True, 0, 52) == (four, (128, 1), 1024, 4 * 128 * 64, True)
    assert R._qb_hist_cfg(1000, 100, 64, True, 0, 52) == (four, (1, 3), 1024, 4 * 128 * 64, True)
    assert R._qb_hist_cfg(65536, 256, 454, True, 0, 52) == (four, (2, 36), 1024, 4 * 128 * 454, True)
    # VPL = 1 at 48 registers: 5 blocks of 256 threads a multiprocessor, 660 resident
    assert R._qb_hist_cfg(65536, 2304, 64, False, 0, 48) == (one, (72, 9), 256, 4 * 32 * 64, True)  # misaligned
    assert R._qb_hist_cfg(65536, 2303, 64, True, 0, 48) == (one, (72, 9), 256, 4 * 32 * 64, True)  # E % 4
    assert R._qb_hist_cfg(7, 37, 5, True, 0, 48) == (one, (2, 1), 256, 4 * 32 * 5, True)
    assert R._qb_hist_cfg(65536, 256, 455, True, 0, 48) == (one, (8, 36), 256, 4 * 32 * 455, True)
    assert R._qb_hist_cfg(65536, 256, 2000, True, 0, 48) == (one, (8, 8), 256, 0, False)  # 32 * 2000 > 227 KiB


def _qb_gpu_run(cp, x, bias, bounds, start, K, mode="fused_atomic"):
    hist = cp.asarray(start)
    outs = R.topk_with_score_qb(cp.asarray(x), K, expert_bias=cp.asarray(bias), qb_histogram=hist,
                                qb_bin_bounds=cp.asarray(bounds), qb_histogram_mode=mode)
    return [a.get() for a in outs] + [hist.get()]


# (T, E, K, B, dtype, ties): the register kernel at 8, 16 and 32 keys a lane, k + 1 by the argmax rounds (<= 9)
# and by the radix select, ties of the cutoff (few distinct logits), odd and 16-bit rows for router_fwd_qb (one
# warp on 16-byte float16 rows: the pass that lists the k + 1 and writes the map, with ties)
QB_PATH_CASES = [(1000, 256, 8, 64, F32, False), (1000, 256, 8, 64, BF16, False), (777, 256, 3, 64, BF16, True),
                 (777, 256, 8, 64, F32, True), (513, 512, 16, 48, F32, False), (513, 512, 12, 48, BF16, True),
                 (300, 1024, 31, 24, F32, False), (300, 1024, 40, 24, BF16, True), (129, 2304, 36, 64, F32, False),
                 (129, 2304, 36, 10, BF16, True), (61, 100, 5, 33, F32, False), (59, 37, 6, 5, np.float16, True),
                 (65, 3000, 64, 8, BF16, False), (97, 1000, 7, 16, np.float16, True)]


def test_gpu_cases_reach_every_selection(monkeypatch):
    """The GPU tables reach every selection of the k + 1 in the QB forward kernels, without ties too:
    router_fwd_qb_reg's argmax rounds (k + 1 <= MOE_RT_QB_ARGMAX_K1) and its radix select (above; its early
    stop leaves thr below the selected keys, which once routed all k + 1 in every row: E = 896, K = 16 of
    GPU_CASES), router_fwd_qb's one-warp argmax (k + 1 <= 8) and radix select, and the larger teams'."""
    k1 = int(re.search(r"#define MOE_RT_QB_ARGMAX_K1 (\d+)", _jit.source("router.cu")).group(1))

    def selection(dtype, E, K, variant):
        monkeypatch.setattr(R, "_FWD_VARIANT", variant)
        dt = np.dtype(dtype)
        name = R._qb_fwd_cfg(dt, 1, E, K, 1, E % (16 // dt.itemsize) == 0, False)[0]
        if name.startswith("router_fwd_qb_reg"):
            return "register", "argmax" if K + 1 <= k1 else "radix"
        if R._team(E, fwd=True) == 32:
            return "one warp", "argmax" if K + 1 <= 8 else "radix"
        return "team", "radix"

    every = {("register", "argmax"), ("register", "radix"), ("one warp", "argmax"), ("one warp", "radix"),
             ("team", "radix")}
    untied = {selection(c[4], c[1], c[2], None) for c in GPU_CASES}
    untied |= {selection(c[4], c[1], c[2], v) for c in QB_PATH_CASES if not c[5] for v in (None, "generic")}
    assert untied == every
    assert {selection(c[4], c[1], c[2], v) for c in QB_PATH_CASES if c[5] for v in (None, "generic")} >= {
        ("register", "argmax"), ("register", "radix"), ("one warp", "argmax"), ("one warp", "radix")}


@pytest.mark.gpu
@pytest.mark.parametrize("case", QB_PATH_CASES,
                         ids=lambda c: f"T{c[0]}-E{c[1]}-K{c[2]}-B{c[3]}-{np.dtype(c[4]).name}{'-ties' if c[5] else ''}")
def test_gpu_kernel_paths_agree(rng, monkeypatch, case):
    """Every path of the QB forward gives the same bits and counts: the register kernel or router_fwd_qb
    (MOE_RT_ROUTER_FWD=generic), the shared-memory or the global-atomic histogram, blocks of a few tokens
    (the shared histogram flushed by many blocks); against the semantics on the device's raw values, the
    plain sigmoid + bias forward and the two-kernel mode."""
    import cupy as cp

    T, E, K, B, dtype, ties = case
    if ties:
        x = (rng.integers(-3, 4, (T, E)) / 2).astype(dtype)
        bias = (rng.integers(-2, 3, E) / 8).astype(F32)
    else:
        x, bias, _ = te_case(rng, T, E, dtype)
        bias = rng.permutation(bias)
    x[T // 2, E // 3] = np.nan  # a NaN logit: selected first, its r NaN (bin 0)
    bounds = np.array([-1.5, 1.5], F32)
    start = rng.integers(0, 1000, (E, B)).astype(np.int32)
    runs = {}
    # (kernel variant, shared histogram bytes, tokens a block, samples for global atomics, register kernel's
    # warps a block): the shared histogram, global atomics, the histogram kernel after the forward, for each
    # forward kernel; blocks of a few tokens; the register kernel's shared histogram on blocks of 4 warps
    many = 1 << 40
    for cfg in [(None, 48 * 1024, 65535, many, 0), (None, 0, 65535, many, 0), (None, 0, 65535, 0, 0),
                ("generic", 48 * 1024, 65535, many, 0), ("generic", 0, 65535, many, 0), ("generic", 0, 65535, 0, 0),
                (None, 48 * 1024, 4, many, 0), ("generic", 48 * 1024, 4, many, 0), (None, 48 * 1024, 65535, many, 4)]:
        for attr, value in zip(("_FWD_VARIANT", "_QB_SMEM_HIST_BYTES", "_QB_BLOCK_TOKENS", "_QB_ATOMIC_SAMPLES",
                                "_QB_REG_WARPS"), cfg):
            monkeypatch.setattr(R, attr, value)
        runs[cfg] = _qb_gpu_run(cp, x, bias, bounds, start, K)
    monkeypatch.setattr(R, "_FWD_VARIANT", None)
    runs["two_kernel"] = _qb_gpu_run(cp, x, bias, bounds, start, K, "two_kernel")
    first = next(iter(runs.values()))
    for key, outs in runs.items():
        for a, b in zip(outs, first):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=str(key))  # NaN included
    probs, rmap, raw, cut, hist = first
    assert np.isnan(raw[T // 2, E // 3]) and rmap[T // 2, E // 3]
    ok = ~np.isnan(raw).any(1)
    sel, wcut = _from_raw(raw[ok], bias, K)
    np.testing.assert_array_equal(rmap[ok], sel)
    np.testing.assert_array_equal(cut[ok], wcut)
    np.testing.assert_array_equal(hist, start + _hist_of(raw, cut, bounds, B))
    assert (hist - start).sum(1).tolist() == [T] * E
    p0, m0, i0 = R.topk_with_score(cp.asarray(x), K, score_function="sigmoid", expert_bias=cp.asarray(bias))
    np.testing.assert_array_equal(rmap, m0.get())
    np.testing.assert_array_equal(probs.view(np.uint8), p0.get().view(np.uint8))
    np.testing.assert_array_equal(raw.view(np.uint8), i0.get().view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [None, "generic"])
def test_gpu_shared_histogram_counters_near_wrap(monkeypatch, variant):
    """One bin an expert and the fewest blocks the 16-bit counters allow (every block under 65536 tokens):
    a counter reaches tens of thousands beside its neighbour in the same word, and the counts stay exact."""
    import cupy as cp

    T, E, K = 140_000, 8, 2
    monkeypatch.setattr(R, "_FWD_VARIANT", variant)
    monkeypatch.setattr(R, "_grid", lambda *a, **k: 1)
    x = np.random.default_rng(5).standard_normal((T, E)).astype(F32)
    hist = cp.full((E, 1), 7, cp.int32)
    R.topk_with_score_qb(cp.asarray(x), K, expert_bias=cp.zeros(E, cp.float32), qb_histogram=hist,
                         qb_bin_bounds=cp.asarray([-1.0, 1.0], cp.float32))
    assert R._qb_hmode(T, E, 1, True) == 2
    np.testing.assert_array_equal(hist.get(), np.full((E, 1), T + 7, np.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(300, 256, 8, 5, BF16), (300, 256, 8, 64, F32), (97, 512, 12, 7, BF16),
                                  (97, 2304, 8, 33, F32)],
                         ids=lambda c: f"T{c[0]}-E{c[1]}-K{c[2]}-B{c[3]}-{np.dtype(c[4]).name}")
def test_gpu_bins_at_extreme_scales(rng, monkeypatch, case):
    """The bin's floor, clamp and conversion at the edges of the scale, on every forward kernel and histogram
    path: upper - lower a denormal (the scale B / (upper - lower) is inf: r = lower gives a NaN, bin 0; the
    rest +-inf, the edge bins), a scale that takes v past 2^31 and 2^32, and one of 0 (upper - lower inf);
    r = lower by experts with zero bias (the cutoff's own r is its bias)."""
    import cupy as cp

    T, E, K, B, dtype = case
    x, bias, _ = te_case(rng, T, E, dtype)
    bias = np.where(rng.random(E) < 0.5, F32(0), rng.permutation(bias) / 64).astype(F32)
    start = rng.integers(0, 1000, (E, B)).astype(np.int32)
    many = 1 << 40
    for bounds in ([0.0, 1e-45], [-1e-9, 1e-9], [-3e38, 3e38]):
        bounds = np.array(bounds, F32)
        runs = []
        for variant, smem in ((None, 48 * 1024), (None, 0), ("generic", 48 * 1024), ("generic", 0)):
            monkeypatch.setattr(R, "_FWD_VARIANT", variant)
            monkeypatch.setattr(R, "_QB_SMEM_HIST_BYTES", smem)
            monkeypatch.setattr(R, "_QB_ATOMIC_SAMPLES", many)
            runs.append(_qb_gpu_run(cp, x, bias, bounds, start, K))
            runs.append(_qb_gpu_run(cp, x, bias, bounds, start, K, "two_kernel"))
        for outs in runs[1:]:
            for a, b in zip(outs, runs[0]):
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=str(bounds))
        _, _, raw, cut, hist = runs[0]
        want = start + _hist_of(raw, cut, bounds, B)
        np.testing.assert_array_equal(hist, want, err_msg=str(bounds))
        if bounds[1] == F32(1e-45):  # NaN (r = lower = 0) and both infinities reached, no bin between
            r = (cut[:, None] - raw).astype(F32)
            assert (r == 0).any() and (r < 0).any() and (r > 0).any()
            d = want - start
            assert d[:, 0].sum() == (r <= 0).sum() and d[:, 1:-1].sum() == 0
