"""The router's routing-output formats: the bit-packed map (``routing_map_format="bitmap_u8"``) and the dense
``topk_indices`` output with its index-driven backward. CPU: the core ops against the NumPy reference, bad
input, the torch and JAX adapters, and ``moe_rt.te`` / ``moe_rt.te_jax`` on TransformerEngine's test grids;
(marker ``gpu``) every kernel variant against the reference and against the byte map, bit for bit."""
import numpy as np
import pytest

import moe_rt.router as R
from moe_rt import _arrays
from moe_rt.reference import router as ref

F32 = np.float32
BF16 = _arrays.BFLOAT16
SCORES = ("softmax", "sigmoid", "sqrtsoftplus")
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _tie_free(rng, lead, E, dtype=F32):
    """Rows of distinct values far apart (random permutations of an even grid plus a row offset)."""
    T = int(np.prod(lead)) if lead else 1
    base = np.linspace(-4, 4, E, dtype=np.float64)
    x = np.stack([rng.permutation(base) for _ in range(T)]) if T else np.zeros((0, E))
    x = x + rng.uniform(-1, 1, (T, 1))
    return x.astype(F32).astype(dtype).reshape(tuple(lead) + (E,))


def _kw(score, pre=False, groups=None, bias=None, scale=None):
    return dict(score_function=score, use_pre_softmax=pre, num_groups=groups[0] if groups else None,
                group_topk=groups[1] if groups else None, scaling_factor=scale, expert_bias=bias)


# ---- the reference helpers ------------------------------------------------------------------------------

def test_pack_bitmap_layout():
    m = np.zeros((2, 10), bool)
    m[0, [0, 3, 8]] = True
    m[1, [7, 9]] = True
    b = ref.pack_bitmap(m)
    assert b.dtype == np.uint8 and b.shape == (2, 2)
    np.testing.assert_array_equal(b, [[0b00001001, 0b00000001], [0b10000000, 0b00000010]])
    np.testing.assert_array_equal(ref.unpack_bitmap(b, 10), m)
    np.testing.assert_array_equal(ref.map_to_indices(m[:1], 3), [[0, 3, 8]])


# ---- CPU: the core ops against the reference -----------------------------------------------------------

# (lead dims, E, K, score, pre, groups, bias, scale): TE's grid shapes and odd ones
CPU_CASES = [
    ((128,), 32, 4, "softmax", False, None, False, None),
    ((256,), 130, 8, "sigmoid", False, None, True, 1.5),
    ((256,), 130, 8, "sqrtsoftplus", False, (10, 2), False, None),
    ((5, 2), 130, 1, "sigmoid", False, None, False, None),
    ((7, 3), 257, 9, "softmax", True, None, False, 2.0),
    ((64,), 1024, 16, "softmax", False, (8, 4), False, None),
    ((0,), 130, 8, "sigmoid", False, None, False, None),
]


def _case_id(c):
    return (f"{'x'.join(map(str, c[0]))}-E{c[1]}-K{c[2]}-{c[3]}{'-pre' if c[4] else ''}{'-g' if c[5] else ''}"
            f"{'-b' if c[6] else ''}")


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_bitmap_equals_packed_bytemap(rng, case):
    lead, E, K, score, pre, groups, bias, scale = case
    x = _tie_free(rng, lead, E)
    b = (rng.permutation(E) * (0.5 / E)).astype(F32) if bias else None
    kw = _kw(score, pre, groups, b, scale)
    probs, bmap, inter = R.topk_with_score(x, K, **kw)
    p2, bits, i2 = R.topk_with_score(x, K, routing_map_format="bitmap_u8", **kw)
    assert bits.dtype == np.uint8 and bits.shape == tuple(lead) + (-(-E // 8),)
    np.testing.assert_array_equal(bits, np.packbits(bmap, axis=-1, bitorder="little"))
    assert (p2.view(np.uint8) == probs.view(np.uint8)).all() and (i2.view(np.uint8) == inter.view(np.uint8)).all()
    if E % 8 and bits.size:
        assert (bits[..., -1] >> (E % 8) == 0).all()  # padding bits 0
    gy = rng.standard_normal(probs.shape).astype(F32)
    bkw = dict(score_function=score, use_pre_softmax=pre, scaling_factor=scale)
    g1 = R.topk_with_score_backward(gy, bmap, inter, K, **bkw)
    g2 = R.topk_with_score_backward(gy, bits, inter, K, routing_map_format="bitmap_u8", **bkw)
    assert g2.shape == g1.shape and (g2.view(np.uint8) == g1.view(np.uint8)).all()


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("lead,E,K", [((128,), 32, 4), ((256,), 128, 8), ((3, 2), 130, 8)])
def test_scores_bitmap_equals_packed_bytemap(rng, score, lead, E, K):
    x = _tie_free(rng, lead, E)
    s1, m1, i1 = R.scores_for_aux_loss(x, K, score)
    s2, m2, i2 = R.scores_for_aux_loss(x, K, score, routing_map_format="bitmap_u8")
    assert m2.dtype == np.uint8 and m2.shape == tuple(lead) + (-(-E // 8),)
    np.testing.assert_array_equal(m2, ref.pack_bitmap(m1))
    np.testing.assert_array_equal(s2, s1)
    np.testing.assert_array_equal(i2, i1)


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
@pytest.mark.parametrize("idt", ["int16", "int32", "int64"])
def test_indices_output(rng, case, idt):
    lead, E, K, score, pre, groups, bias, scale = case
    x = _tie_free(rng, lead, E)
    b = (rng.permutation(E) * (0.5 / E)).astype(F32) if bias else None
    kw = _kw(score, pre, groups, b, scale)
    probs, bmap, inter = R.topk_with_score(x, K, **kw)
    # a dtype
    p2, idx, i2 = R.topk_with_score(x, K, topk_indices_dtype=idt, **kw)
    assert idx.dtype == np.dtype(idt) and idx.shape == tuple(lead) + (K,)
    np.testing.assert_array_equal(idx, ref.map_to_indices(bmap, K))  # ascending expert id
    np.testing.assert_array_equal(p2, probs)
    np.testing.assert_array_equal(i2, inter)
    # a caller buffer, poisoned: written in place, returned as itself
    buf = np.full(tuple(lead) + (K,), -7, dtype=idt)
    p3, out, _ = R.topk_with_score(x, K, topk_indices=buf, **kw)
    assert out is buf
    np.testing.assert_array_equal(buf, idx)
    np.testing.assert_array_equal(p3, probs)
    # the backward from the indices: the reference's, and the map's up to summation order
    gy = rng.standard_normal(probs.shape).astype(F32)
    bkw = dict(score_function=score, use_pre_softmax=pre, scaling_factor=scale)
    gi = R.topk_with_score_backward(gy, None, inter, K, topk_indices=buf, **bkw)
    want = ref.topk_with_score_bwd_indices(gy.reshape(-1, E), idx.reshape(-1, K), inter.reshape(-1, E), K, pre,
                                           scale, score)
    np.testing.assert_array_equal(gi.reshape(-1, E), want)
    gm = R.topk_with_score_backward(gy, bmap, inter, K, **bkw)
    np.testing.assert_allclose(gi, gm, rtol=1e-5, atol=1e-6)
    if not pre:
        assert (gi[~bmap] == 0).all()


def test_index_backward_row_order_and_skipped_ids(rng):
    """Indices in any order within a row give the same gradient up to summation order; -1 selects nothing."""
    E, K = 40, 6
    x = _tie_free(rng, (33,), E)
    for score in SCORES:
        probs, m, inter = R.topk_with_score(x, K, score_function=score)
        idx = ref.map_to_indices(m, K)
        shuffled = np.stack([rng.permutation(r) for r in idx]).astype(np.int32)
        gy = rng.standard_normal(probs.shape).astype(F32)
        g1 = R.topk_with_score_backward(gy, None, inter, K, score_function=score, topk_indices=idx)
        g2 = R.topk_with_score_backward(gy, None, inter, K, score_function=score, topk_indices=shuffled)
        np.testing.assert_allclose(g2, g1, rtol=1e-6, atol=1e-7)
        dropped = idx.copy()
        dropped[:, 0] = -1
        g3 = R.topk_with_score_backward(gy, None, inter, K, score_function=score, topk_indices=dropped)
        m3 = m.copy()
        m3[np.arange(len(idx)), idx[:, 0]] = False
        want = ref.topk_with_score_bwd(gy, m3, inter, K, False, None, score)
        np.testing.assert_allclose(g3, want, rtol=1e-5, atol=1e-6)


def test_index_backward_bf16(rng):
    x = _tie_free(rng, (9,), 64, BF16)
    probs, m, inter = R.topk_with_score(x, 4, score_function="sigmoid")
    _, idx, _ = R.topk_with_score(x, 4, score_function="sigmoid", topk_indices_dtype=np.int16)
    gy = rng.standard_normal(probs.shape).astype(F32).astype(BF16)
    g = R.topk_with_score_backward(gy, None, inter, 4, score_function="sigmoid", topk_indices=idx)
    assert g.dtype == BF16
    want = ref.topk_with_score_bwd_indices(gy, idx, inter, 4, False, None, "sigmoid")
    np.testing.assert_array_equal(g.view(np.uint16), want.view(np.uint16))


# ---- bad input -----------------------------------------------------------------------------------------

def test_bad_input():
    x = np.linspace(-1, 1, 4 * 16, dtype=F32).reshape(4, 16)
    with pytest.raises(ValueError, match="routing_map_format"):
        R.topk_with_score(x, 2, routing_map_format="BITMAP_U8")
    with pytest.raises(TypeError, match="routing_map_format"):
        R.topk_with_score(x, 2, routing_map_format=1)
    with pytest.raises(ValueError, match="routing_map_format"):
        R.scores_for_aux_loss(x, 2, "softmax", routing_map_format="bitmap")
    with pytest.raises(ValueError, match="bitmap_u8"):
        R.topk_with_score(x, 2, routing_map_format="bitmap_u8", topk_indices_dtype=np.int32)
    with pytest.raises(ValueError, match="bitmap_u8"):
        R.topk_with_score(x, 2, routing_map_format="bitmap_u8", topk_indices=np.zeros((4, 2), np.int32))
    with pytest.raises(ValueError, match="not both"):
        R.topk_with_score(x, 2, topk_indices=np.zeros((4, 2), np.int32), topk_indices_dtype=np.int32)
    big = np.zeros((1, 40000), F32)
    with pytest.raises(ValueError, match="32767"):
        R.topk_with_score(big, 2, topk_indices_dtype="int16")
    with pytest.raises(ValueError, match="32767"):
        R.topk_with_score(big, 2, topk_indices=np.zeros((1, 2), np.int16))
    with pytest.raises(ValueError, match="topk_indices_dtype"):
        R.topk_with_score(x, 2, topk_indices_dtype=np.uint8)
    with pytest.raises(TypeError, match="topk_indices_dtype"):
        R.topk_with_score(x, 2, topk_indices_dtype=object())
    with pytest.raises(TypeError, match="topk_indices"):
        R.topk_with_score(x, 2, topk_indices=np.zeros((4, 2), np.float32))
    with pytest.raises(TypeError, match="topk_indices"):
        R.topk_with_score(x, 2, topk_indices=[[0, 1]] * 4)
    with pytest.raises(ValueError, match="topk_indices"):
        R.topk_with_score(x, 2, topk_indices=np.zeros((4, 3), np.int32))
    with pytest.raises(ValueError, match="topk_indices"):
        R.topk_with_score(x, 2, topk_indices=np.zeros((4, 4), np.int32)[:, ::2])
    ro = np.zeros((4, 2), np.int32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        R.topk_with_score(x, 2, topk_indices=ro)

    probs, m, inter = R.topk_with_score(x, 2)
    g = np.ones_like(probs)
    bits = ref.pack_bitmap(m)
    with pytest.raises(TypeError, match="routing_map"):
        R.topk_with_score_backward(g, m, inter, 2, score_function="softmax", routing_map_format="bitmap_u8")
    with pytest.raises(ValueError, match="routing_map"):
        R.topk_with_score_backward(g, np.zeros((4, 3), np.uint8), inter, 2, score_function="softmax",
                                   routing_map_format="bitmap_u8")
    with pytest.raises(TypeError, match="routing_map"):
        R.topk_with_score_backward(g, bits, inter, 2, score_function="softmax")
    x130 = np.linspace(-1, 1, 2 * 130, dtype=F32).reshape(2, 130)
    p130, m130, i130 = R.topk_with_score(x130, 2)
    b130 = ref.pack_bitmap(m130)
    b130[:, -1] |= 0x80  # a padding bit
    with pytest.raises(ValueError, match="padding"):
        R.topk_with_score_backward(np.ones_like(p130), b130, i130, 2, score_function="softmax",
                                   routing_map_format="bitmap_u8")
    idx = ref.map_to_indices(m, 2)
    with pytest.raises(ValueError, match="one"):
        R.topk_with_score_backward(g, m, inter, 2, score_function="softmax", topk_indices=idx)
    with pytest.raises(TypeError, match="routing_map"):
        R.topk_with_score_backward(g, None, inter, 2, score_function="softmax")
    with pytest.raises(ValueError, match="bitmap_u8"):
        R.topk_with_score_backward(g, None, inter, 2, score_function="softmax", routing_map_format="bitmap_u8",
                                   topk_indices=idx)
    with pytest.raises(ValueError, match="topk_indices"):
        R.topk_with_score_backward(g, None, inter, 3, score_function="softmax", topk_indices=idx)
    with pytest.raises(TypeError, match="topk_indices"):
        R.topk_with_score_backward(g, None, inter, 2, score_function="softmax", topk_indices=idx.astype(F32))
    bad = idx.copy()
    bad[1, 1] = 16
    with pytest.raises(ValueError, match="topk_indices: expert ids must be in"):
        R.topk_with_score_backward(g, None, inter, 2, score_function="softmax", topk_indices=bad)


def test_bitmap_into_dispatch_refused():
    import moe_rt

    m = np.zeros((4, 20), bool)
    m[:, :2] = True
    bits = ref.pack_bitmap(m)
    for map_type in (None, "mask"):
        with pytest.raises(TypeError, match="bit-packed"):
            moe_rt.make_plan(bits, 20, map_type=map_type)


# ---- torch adapter -------------------------------------------------------------------------------------

def test_torch_autograd_formats(rng):
    torch = pytest.importorskip("torch")
    import moe_rt.torch as mt

    x0 = torch.from_numpy(_tie_free(rng, (6, 2), 130))
    gy = torch.from_numpy(rng.standard_normal((6, 2, 130)).astype(F32))
    for score in SCORES:
        kw = dict(score_function=score, scaling_factor=1.3)
        grads, outs = [], []
        for extra in ({}, {"routing_map_format": "bitmap_u8"}, {"topk_indices_dtype": torch.int16},
                      {"topk_indices": torch.full((6, 2, 8), -7, dtype=torch.int64)}):
            x = x0.clone().requires_grad_(True)
            probs, routing = mt.topk_with_score(x, 8, **kw, **extra)
            (probs * gy).sum().backward()
            grads.append(x.grad)
            outs.append((probs.detach(), routing))
            if "topk_indices" in extra:
                assert routing is extra["topk_indices"]
        (p0, m0), (p1, b1), (p2, i2), (p3, i3) = outs
        assert torch.equal(p0, p1) and torch.equal(p0, p2) and torch.equal(p0, p3)
        np.testing.assert_array_equal(b1.numpy(), ref.pack_bitmap(m0.numpy()))
        assert i2.dtype == torch.int16 and i2.shape == (6, 2, 8)
        np.testing.assert_array_equal(i2.numpy(), ref.map_to_indices(m0.numpy(), 8))
        np.testing.assert_array_equal(i3.numpy(), i2.numpy())
        assert torch.equal(grads[0], grads[1])  # the bitmap's gradient is the byte map's, bit for bit
        torch.testing.assert_close(grads[2], grads[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grads[3], grads[0], rtol=1e-5, atol=1e-6)
    # aux scores with the bitmap: same scores and gradient
    x = x0.clone().requires_grad_(True)
    s, m = mt.scores_for_aux_loss(x, 4, "sigmoid")
    (s * gy).sum().backward()
    x2 = x0.clone().requires_grad_(True)
    s2, b = mt.scores_for_aux_loss(x2, 4, "sigmoid", routing_map_format="bitmap_u8")
    (s2 * gy).sum().backward()
    np.testing.assert_array_equal(b.numpy(), ref.pack_bitmap(m.numpy()))
    assert torch.equal(x.grad, x2.grad)


def test_torch_compile_formats(rng):
    torch = pytest.importorskip("torch")
    import moe_rt.torch as mt

    x0 = torch.from_numpy(_tie_free(rng, (12,), 40))
    gy = torch.from_numpy(rng.standard_normal((12, 40)).astype(F32))

    def f(x, buf):
        p1, b = mt.topk_with_score(x, 4, score_function="sigmoid", routing_map_format="bitmap_u8")
        p2, i = mt.topk_with_score(x, 4, score_function="sigmoid", topk_indices_dtype=torch.int32)
        p3, i3 = mt.topk_with_score(x, 4, score_function="sigmoid", topk_indices=buf)
        s, sb = mt.scores_for_aux_loss(x, 4, "softmax", routing_map_format="bitmap_u8")
        return ((p1 + p2 + p3) * gy).sum() + (s * gy).sum(), b, i, i3, sb

    x = x0.clone().requires_grad_(True)
    buf = torch.full((12, 4), -7, dtype=torch.int16)
    loss, b, i, i3, sb = torch.compile(f, fullgraph=True)(x, buf)
    loss.backward()
    xe = x0.clone().requires_grad_(True)
    buf_e = torch.full((12, 4), -7, dtype=torch.int16)
    loss_e, b_e, i_e, i3_e, sb_e = f(xe, buf_e)
    loss_e.backward()
    assert i3 is buf and torch.equal(buf, buf_e) and torch.equal(b, b_e) and torch.equal(i, i_e)
    assert torch.equal(sb, sb_e) and b.dtype == torch.uint8 and b.shape == (12, 5)
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-6, atol=1e-7)


# ---- JAX adapter ---------------------------------------------------------------------------------------

def test_jax_formats(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import moe_rt.jax as mj

    x = jnp.asarray(_tie_free(rng, (5, 2), 130))
    gy = jnp.asarray(rng.standard_normal((5, 2, 130)).astype(F32))

    def loss(x, fmt, idt):
        p, r = mj.topk_with_score(x, 8, score_function="sigmoid", scaling_factor=1.2, routing_map_format=fmt,
                                  topk_indices_dtype=idt)
        return (p * gy).sum(), r

    vg = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=(1, 2))
    (l0, m), g0 = vg(x, "bytemap", None)
    (l1, b), g1 = vg(x, "bitmap_u8", None)
    (l2, idx), g2 = vg(x, "bytemap", "int16")
    assert b.dtype == jnp.uint8 and b.shape == (5, 2, 17) and idx.dtype == jnp.int16 and idx.shape == (5, 2, 8)
    np.testing.assert_array_equal(np.asarray(b), ref.pack_bitmap(np.asarray(m)))
    np.testing.assert_array_equal(np.asarray(idx), ref.map_to_indices(np.asarray(m), 8))
    assert float(l0) == float(l1) == float(l2)
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g0))
    np.testing.assert_allclose(np.asarray(g2), np.asarray(g0), rtol=1e-5, atol=1e-6)
    s, sb = jax.jit(lambda x: mj.scores_for_aux_loss(x, 4, "softmax", routing_map_format="bitmap_u8"))(x)
    _, sm = mj.scores_for_aux_loss(x, 4, "softmax")
    np.testing.assert_array_equal(np.asarray(sb), ref.pack_bitmap(np.asarray(sm)))
    if not jax.config.jax_enable_x64:
        with pytest.raises(ValueError, match="jax_enable_x64"):
            mj.topk_with_score(x, 8, topk_indices_dtype=jnp.int64)
    with pytest.raises(ValueError, match="bitmap_u8"):
        mj.topk_with_score(x, 8, routing_map_format="bitmap_u8", topk_indices_dtype=jnp.int32)


# ---- moe_rt.te: TransformerEngine's tests ---------------------------------------------------------------

def _te_logits(torch, T, E, score, device):
    """TE's test logits: strictly monotone, so the top-k sets are unique."""
    if score == "softmax":
        v = torch.arange(-T * E // 2, T * E // 2, dtype=torch.float32) * 1e-4
        return v.reshape(T, E)[:, torch.randperm(E)].to(device)
    x = torch.arange(-E // 2, E // 2, dtype=torch.float32) * 1e-2
    x = x[torch.randperm(E)].unsqueeze(0) + (torch.arange(-T // 2, T // 2, dtype=torch.float32) * 1e-4).unsqueeze(1)
    return x.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("T,E,K", [(128, 32, 4), (256, 128, 8), (256, 130, 8), (128, 1024, 16)])
def test_te_topk_bitmap_vs_bytemap(device, score, T, E, K):
    """TE's test_topk_bitmap_vs_bytemap: equal probs, uint8 [T, ceil(E/8)], bitmap == packbits(bytemap),
    equal grads of probs.sum() (atol = rtol = 0)."""
    torch = pytest.importorskip("torch")
    import moe_rt.te as te

    torch.manual_seed(T + E + K)
    logits = _te_logits(torch, T, E, score, device)
    outs = []
    for fmt in (te.RoutingMapFormat.BYTEMAP, te.RoutingMapFormat.BITMAP_U8):
        x = logits.clone().requires_grad_(True)
        probs, rmap = te.fused_topk_with_score_function(x, K, False, None, None, None, score, None,
                                                        routing_map_format=fmt)
        probs.sum().backward()
        outs.append((probs.detach(), rmap, x.grad))
    (p0, m0, g0), (p1, b1, g1) = outs
    assert b1.dtype == torch.uint8 and tuple(b1.shape) == (T, (E + 7) // 8)
    torch.testing.assert_close(p1, p0, atol=0, rtol=0)
    np.testing.assert_array_equal(b1.cpu().numpy(), np.packbits(m0.cpu().numpy(), axis=-1, bitorder="little"))
    torch.testing.assert_close(g1, g0, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("T,E,K", [(128, 32, 4), (256, 128, 8), (256, 130, 8)])
def test_te_score_for_aux_loss_bitmap_vs_bytemap(device, score, T, E, K):
    torch = pytest.importorskip("torch")
    import moe_rt.te as te

    torch.manual_seed(T + E)
    logits = _te_logits(torch, T, E, score, device)
    outs = []
    for fmt in ("bytemap", "bitmap_u8"):
        x = logits.clone().requires_grad_(True)
        rmap, scores = te.fused_compute_score_for_moe_aux_loss(x, K, score, routing_map_format=fmt)
        scores.sum().backward()
        outs.append((rmap, scores.detach(), x.grad))
    (m0, s0, g0), (b1, s1, g1) = outs
    assert b1.dtype == torch.uint8 and tuple(b1.shape) == (T, (E + 7) // 8)
    np.testing.assert_array_equal(b1.cpu().numpy(), np.packbits(m0.cpu().numpy(), axis=-1, bitorder="little"))
    torch.testing.assert_close(s1, s0, atol=0, rtol=0)
    torch.testing.assert_close(g1, g0, atol=0, rtol=0)


def _torch_topk_ref(torch, logits, K, score, pre, groups, scale, bias):
    """The plain torch router of TE's tests (no groups here: the grouped cases compare against moe_rt's
    byte map, checked against the NumPy reference elsewhere), in float64."""
    x = logits.double()
    if score == "softmax":
        if pre:
            s = torch.softmax(x, -1)
            v, i = torch.topk(s, K, -1)
            p = v
        else:
            v, i = torch.topk(x, K, -1)
            p = torch.softmax(v, -1)
    else:
        s = torch.sigmoid(x) if score == "sigmoid" else torch.sqrt(torch.nn.functional.softplus(x))
        sel = s + bias.double() if bias is not None else s
        _, i = torch.topk(sel, K, -1)
        p = torch.gather(s, -1, i)
        if K > 1:
            p = p / (p.sum(-1, keepdim=True) + 1e-20)
    p = p * (1.0 if scale is None else scale)
    probs = torch.zeros_like(x).scatter(-1, i, p)
    rmap = torch.zeros_like(x, dtype=torch.bool).scatter(-1, i, True)
    return probs, rmap


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("idt", [None, "int16", "int32", "int64"])
@pytest.mark.parametrize("T,E,K,pre,bias,scale", [(257, 128, 4, False, False, None), (300, 32, 8, True, True, 1.2),
                                                    (129, 1024, 16, False, True, None)])
def test_te_topk_index_dtype(device, score, idt, T, E, K, pre, bias, scale):
    """TE's test_topk_{sigmoid,sqrtsoftplus,softmax} with topk_index_dtype: the output aliases the buffer and
    has its dtype, the indices as a bool map equal torch.topk's, probs and the grad of sum(probs) within TE's
    tolerances."""
    torch = pytest.importorskip("torch")
    import moe_rt.te as te

    torch.manual_seed(T * K)
    logits = _te_logits(torch, T, E, score, device)
    b = (torch.arange(E, dtype=torch.float32) * 0.1).flip(0).to(device) if bias and score != "softmax" else None
    pre = pre and score == "softmax"
    x = logits.clone().requires_grad_(True)
    buf = None if idt is None else torch.full((T, K), -7, dtype=getattr(torch, idt), device=device)
    probs, routing = te.fused_topk_with_score_function(x, K, pre, None, None, scale, score, b, topk_indices=buf)
    probs.sum().backward()
    xr = logits.clone().double().requires_grad_(True)
    rp, rm = _torch_topk_ref(torch, xr, K, score, pre, None, scale, b)
    rp.sum().backward()
    tol = dict(atol=max(1e-5, 4e-7 * E), rtol=max(1.3e-6, 4e-7 * E))
    if buf is None:
        assert routing.dtype == torch.bool
        assert torch.equal(routing.cpu(), rm.cpu())
    else:
        assert routing is buf and routing.dtype == getattr(torch, idt)
        as_map = torch.zeros(T, E, dtype=torch.bool, device=device).scatter(-1, routing.long(), True)
        assert torch.equal(as_map.cpu(), rm.cpu())
        assert (routing.diff(dim=-1) > 0).all()  # ascending expert id
    torch.testing.assert_close(probs.double().cpu(), rp.detach().cpu(), **tol)
    torch.testing.assert_close(x.grad.double().cpu(), xr.grad.cpu(), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_te_topk_preserves_leading_dims(device):
    torch = pytest.importorskip("torch")
    import moe_rt.te as te

    logits = torch.randn(128, 2, 32, device=device)
    buf = torch.empty(128, 2, 4, dtype=torch.int32, device=device)
    probs, idx = te.fused_topk_with_score_function(logits, 4, False, None, None, None, "sigmoid", None,
                                                   topk_indices=buf)
    assert idx is buf and tuple(idx.shape) == (128, 2, 4) and tuple(probs.shape) == (128, 2, 32)
    _, bits = te.fused_topk_with_score_function(logits, 4, False, None, None, None, "sigmoid", None,
                                                routing_map_format=1)
    assert tuple(bits.shape) == (128, 2, 4) and bits.dtype == torch.uint8


def test_te_bad_input():
    torch = pytest.importorskip("torch")
    import moe_rt.te as te

    logits = torch.randn(8, 16)
    args = (logits, 2, False, None, None, None, "sigmoid", None)
    with pytest.raises(ValueError, match="routing_map_format"):
        te.fused_topk_with_score_function(*args, routing_map_format=te.RoutingMapFormat.BITMAP_U8,
                                          topk_indices=torch.empty(8, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_indices"):
        te.fused_topk_with_score_function(*args, topk_indices=torch.empty(8, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="topk_indices"):
        te.fused_topk_with_score_function(*args, topk_indices=torch.empty(8, 2, dtype=torch.float32))
    with pytest.raises(ValueError, match="topk_indices"):
        te.fused_topk_with_score_function(*args, topk_indices=torch.empty(8, 4, dtype=torch.int32)[:, ::2])
    big = torch.zeros(2, 40000)
    with pytest.raises(ValueError, match="32767"):
        te.fused_topk_with_score_function(big, 2, False, None, None, None, "sigmoid", None,
                                          topk_indices=torch.empty(2, 2, dtype=torch.int16))
    m = torch.zeros(8, 16, dtype=torch.bool)
    m[:, :2] = True
    bits = torch.from_numpy(ref.pack_bitmap(m.numpy()))
    x = torch.randn(8, 4)
    with pytest.raises(TypeError, match="bit-packed"):
        te.moe_permute(x, bits, 16)
    with pytest.raises(TypeError, match="bit-packed"):
        te.moe_permute_with_probs(x, torch.rand(8, 2), bits, 16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("aux", [False, True])
def test_te_jax_bitmap_vs_bytemap(device, score, aux):
    """TE JAX's bitmap tests under jit, zero tolerance, for the router and the aux scores."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    tj = pytest.importorskip("moe_rt.te_jax")
    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    rng = np.random.default_rng(7)
    for T, E, K in [(128, 32, 4), (256, 130, 8)]:
        logits = jax.device_put(jnp.asarray(rng.permutation(T * E).reshape(T, E).astype(F32) * 1e-3), dev)

        def loss(x, fmt):
            p, m = tj.fused_topk_with_score_function(x, K, score_function=score, compute_aux_scores=aux,
                                                     routing_map_format=fmt)
            return p.sum(), m

        vg = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
        (l0, m0), g0 = vg(logits, tj.RoutingMapFormat.BYTEMAP)
        (l1, b1), g1 = vg(logits, tj.RoutingMapFormat.BITMAP_U8)
        assert b1.dtype == jnp.uint8 and b1.shape == (T, (E + 7) // 8)
        np.testing.assert_array_equal(np.asarray(b1), np.packbits(np.asarray(m0), axis=-1, bitorder="little"))
        assert float(l0) == float(l1)
        np.testing.assert_array_equal(np.asarray(g1), np.asarray(g0))
    with pytest.raises(TypeError, match="bit-packed"):
        tj.token_dispatch(jnp.ones((128, 8)), b1[:128], 8)


# ---- GPU: the kernels ----------------------------------------------------------------------------------

def _poison_pool(nbytes=64 << 20):
    """Free memory of CuPy's pool filled with 0xFF: anything a kernel leaves unwritten shows up."""
    import cupy as cp

    a = cp.empty(int(nbytes), dtype=cp.uint8)
    a.fill(0xFF)
    del a


# (T, E, K, dtype, score, pre, groups, bias, scale): every forward kernel (register kernel at 8/16/32 keys a
# lane, with and without groups, LANESEL and select_reg8; one-warp generic kernel with 8- and 4-key passes
# and an E % 8 != 0 row; 128- and 512-thread teams; rows that are not 16-byte vectors) and every backward
# kernel (selected-entry one-round, two-pass and register kernels; the dense kernel for pre-softmax)
GPU_CASES = [
    (4099, 256, 8, F32, "softmax", False, None, False, None),
    (4099, 256, 8, BF16, "softmax", False, None, False, None),
    (4099, 256, 8, BF16, "sigmoid", False, (8, 4), True, 2.5),
    (517, 256, 8, F32, "sigmoid", False, (8, 4), True, None),
    (517, 256, 4, BF16, "sigmoid", False, (8, 2), False, None),
    (517, 512, 16, F32, "sqrtsoftplus", False, None, True, None),
    (517, 1024, 36, F32, "softmax", False, None, False, 1.2),
    (517, 1020, 36, F32, "sigmoid", False, (5, 4), True, None),
    (517, 132, 8, F32, "sigmoid", False, None, False, None),
    (517, 1316, 12, F32, "softmax", False, None, False, None),
    (517, 2304, 36, BF16, "sigmoid", False, (8, 4), True, None),
    (517, 2304, 36, np.float16, "softmax", False, None, False, None),
    (517, 2304, 36, F32, "softmax", False, None, False, None),  # the benchmark's row: byte map router_bwd_sel_reg<float, 128>, bitmap router_bwd_sel<float, 128, true>
    (129, 3000, 20, F32, "sqrtsoftplus", False, None, False, None),
    (7, 16384, 64, F32, "softmax", False, None, False, None),
    (7, 16384, 36, BF16, "sigmoid", False, (64, 4), True, None),
    (517, 256, 8, F32, "softmax", True, (8, 4), False, 1.0),
    (7, 130, 26, F32, "sigmoid", False, (10, 2), False, None),
    (4099, 130, 36, BF16, "softmax", False, None, False, 1.2),
    (33, 130, 2, np.float16, "softmax", True, None, False, None),
    (0, 256, 8, F32, "softmax", False, None, False, None),
    (1, 8, 1, F32, "sigmoid", False, None, False, None),
]


def _gpu_id(c):
    return (f"T{c[0]}-E{c[1]}-K{c[2]}-{np.dtype(c[3]).name}-{c[4]}{'-pre' if c[5] else ''}{'-g' if c[6] else ''}"
            f"{'-b' if c[7] else ''}")


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and (a.view(np.uint8) == b.view(np.uint8)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_gpu_id)
def test_gpu_bitmap(rng, case):
    import cupy as cp

    T, E, K, dtype, score, pre, groups, bias, scale = case
    x = cp.asarray(_tie_free(rng, (T,), E, dtype))
    b = cp.asarray((rng.permutation(E) * (0.5 / E)).astype(F32)) if bias else None
    kw = _kw(score, pre, groups, b, scale)
    probs, m, inter = (a.get() for a in R.topk_with_score(x, K, **kw))
    _poison_pool()
    p2, bits, i2 = (a.get() for a in R.topk_with_score(x, K, routing_map_format="bitmap_u8", **kw))
    assert bits.dtype == np.uint8 and bits.shape == (T, -(-E // 8))
    np.testing.assert_array_equal(bits, ref.pack_bitmap(m))  # padding bits 0 included
    assert _bits_equal(p2, probs) and _bits_equal(i2, inter)
    # the byte map agrees with the reference (tie-free rows; near ties only with bias or groups)
    rp, rm, _ = ref.topk_with_score_fwd(x.get(), K, **_kw(score, pre, groups, None if b is None else b.get(), scale))
    if not bias and not groups:
        np.testing.assert_array_equal(m, rm)
    assert (m.sum(1) == K).all()
    # the backward from the bitmap: the byte map's, bit for bit
    gy = cp.asarray(rng.standard_normal((T, E)).astype(F32).astype(dtype))
    bkw = dict(score_function=score, use_pre_softmax=pre, scaling_factor=scale)
    g1 = R.topk_with_score_backward(gy, cp.asarray(m), cp.asarray(inter), K, **bkw).get()
    _poison_pool()
    g2 = R.topk_with_score_backward(gy, cp.asarray(bits), cp.asarray(inter), K, routing_map_format="bitmap_u8",
                                    **bkw).get()
    assert _bits_equal(g2, g1)
    # reproducible
    assert _bits_equal(R.topk_with_score(x, K, routing_map_format="bitmap_u8", **kw)[1].get(), bits)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_gpu_id)
@pytest.mark.parametrize("idt", [np.int16, np.int32, np.int64])
def test_gpu_indices(rng, case, idt):
    import cupy as cp

    T, E, K, dtype, score, pre, groups, bias, scale = case
    xh = _tie_free(rng, (T,), E, dtype)
    x = cp.asarray(xh)
    b = cp.asarray((rng.permutation(E) * (0.5 / E)).astype(F32)) if bias else None
    kw = _kw(score, pre, groups, b, scale)
    probs, m, inter = (a.get() for a in R.topk_with_score(x, K, **kw))
    buf = cp.full((T, K), -7, dtype=idt)
    _poison_pool()
    p2, out, i2 = R.topk_with_score(x, K, topk_indices=buf, **kw)
    assert out is buf
    np.testing.assert_array_equal(buf.get(), ref.map_to_indices(m, K))
    assert _bits_equal(p2.get(), probs) and _bits_equal(i2.get(), inter)
    _poison_pool()
    _, idx, _ = R.topk_with_score(x, K, topk_indices_dtype=idt, **kw)
    assert idx.dtype == idt
    np.testing.assert_array_equal(idx.get(), buf.get())
    # the backward from the indices: the reference's index backward (summation order aside)
    gy = rng.standard_normal((T, E)).astype(F32).astype(dtype)
    bkw = dict(score_function=score, use_pre_softmax=pre, scaling_factor=scale)
    _poison_pool()
    g = R.topk_with_score_backward(cp.asarray(gy), None, cp.asarray(inter), K, topk_indices=buf, **bkw).get()
    want = ref.topk_with_score_bwd_indices(gy, buf.get(), inter, K, pre, scale, score)
    assert g.dtype == np.dtype(dtype)
    if not pre:
        assert (g[~m].astype(F32) == 0).all()
    if dtype == F32:
        t = max(1e-5, 4e-7 * E)
        np.testing.assert_allclose(g, want, rtol=t, atol=t)
    else:
        sc = np.abs(want.astype(F32)).max(1, keepdims=True) + 1e-30
        np.testing.assert_allclose(g.astype(F32) / sc, want.astype(F32) / sc, atol=2 ** -7)


@pytest.mark.gpu
@pytest.mark.parametrize("E,K,dtype,score", [(256, 8, F32, "softmax"), (130, 36, BF16, "sigmoid"),
                                             (2304, 36, BF16, "sqrtsoftplus"), (16384, 64, F32, "softmax"),
                                             (132, 8, F32, "sigmoid")])
def test_gpu_aux_scores_bitmap(rng, E, K, dtype, score):
    import cupy as cp

    x = cp.asarray(_tie_free(rng, (517,), E, dtype))
    s, m, i = (a.get() for a in R.scores_for_aux_loss(x, K, score))
    _poison_pool()
    s2, bits, i2 = (a.get() for a in R.scores_for_aux_loss(x, K, score, routing_map_format="bitmap_u8"))
    np.testing.assert_array_equal(bits, ref.pack_bitmap(m))
    assert _bits_equal(s2, s) and _bits_equal(i2, i)
    np.testing.assert_array_equal(m, ref.scores_for_aux_loss_fwd(x.get(), K, score)[1])


@pytest.mark.gpu
def test_gpu_bad_ids_and_devices():
    import cupy as cp
    import moe_rt

    x = cp.asarray(np.linspace(-1, 1, 8 * 16, dtype=F32).reshape(8, 16))
    probs, m, inter = R.topk_with_score(x, 2)
    idx = cp.asarray(ref.map_to_indices(m.get(), 2).astype(np.int32))
    idx[3, 1] = 99
    g = R.topk_with_score_backward(cp.ones_like(probs), None, inter, 2, score_function="softmax", topk_indices=idx)
    with pytest.raises(ValueError, match="topk_indices: expert ids must be in"):
        moe_rt.check()
    assert (g[3].get() != 0).sum() == 1  # the bad id is skipped, nothing written out of bounds
    with pytest.raises(ValueError, match="topk_indices"):  # a CPU buffer for CUDA logits
        R.topk_with_score(x, 2, topk_indices=np.zeros((8, 2), np.int32))
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="topk_indices"):
        R.topk_with_score(torch.as_tensor(x), 2, topk_indices=torch.zeros(8, 2, dtype=torch.int32))
