"""moe_rt.te and moe_rt.te_jax (TransformerEngine's names and signatures) against moe_rt's core ops (same
bits) and against plain torch / jax.numpy implementations of TransformerEngine's documented semantics
(specs/te-parity.md); bad input raises TransformerEngine's errors as ValueError/TypeError, and arguments of
features moe_rt lacks raise NotImplementedError. CPU tensors here; GPU-marked twins run the kernels."""
import numpy as np
import pytest

import moe_rt

torch = pytest.importorskip("torch")
te = pytest.importorskip("moe_rt.te")

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _mask(T, E, K, gen, device, n_out=None):
    """A random bool routing map with K experts per token (then only n_out ones kept, TE's test style)."""
    m = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        m[t, torch.randperm(E, generator=gen)[:K]] = True
    if n_out is not None:
        keep = torch.nonzero(m.reshape(-1))[:, 0]
        drop = keep[torch.randperm(keep.numel(), generator=gen)[n_out:]]
        m.view(-1)[drop] = False
    return m.to(device)


# -- plain torch versions of TransformerEngine's semantics -----------------------------------------------

def plain_permute_mask(x, m, probs=None):
    """Expert-major, token-ascending rows (nothing dropped)."""
    e, t = torch.nonzero(m.t(), as_tuple=True)
    out = x[t]
    pp = None if probs is None else probs.t()[e, t]
    return out, pp, e, t


def plain_unpermute(rows, e, t, T, weights=None):
    acc = torch.zeros(T, rows.shape[1], dtype=torch.float32, device=rows.device)
    w = rows.float() if weights is None else rows.float() * weights[t, e].float()[:, None]
    return acc.index_add(0, t, w).to(rows.dtype)


def plain_permute_index(x, idx, num_out):
    T, K = idx.shape
    order = torch.sort(idx.reshape(-1).long(), stable=True).indices
    kept = order[:num_out]
    row_id = torch.full((T * K,), -1, dtype=torch.int32, device=x.device)
    row_id[kept] = torch.arange(kept.numel(), dtype=torch.int32, device=x.device)
    return x[kept // K], row_id.view(T, K).t().reshape(-1)


# -- router ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("score_function,pre", [("softmax", False), ("softmax", True), ("sigmoid", False),
                                                ("sqrtsoftplus", False)])
def test_topk_same_bits_as_core_and_plain(device, score_function, pre):
    gen = _gen(1)
    T, E, K = 67, 32, 4
    logits = (torch.randperm(T * E, generator=gen).float() * 1e-3).view(T, E).to(device)  # no ties
    bias = torch.linspace(-0.1, 0.1, E).to(device) if score_function != "softmax" else None
    lg = logits.clone().requires_grad_()
    probs, rmap = te.fused_topk_with_score_function(lg, K, pre, None, None, 1.5, score_function, bias)
    cp, cm, _ = moe_rt.topk_with_score(logits, K, score_function=score_function, use_pre_softmax=pre,
                                       scaling_factor=1.5, expert_bias=bias)
    assert torch.equal(probs.detach(), cp) and torch.equal(rmap, cm)
    assert probs.dtype == logits.dtype and rmap.dtype == torch.bool
    # plain torch, in float64 (torch's fp32 softplus on a CPU differed from process to process by up to 3e-4
    # relative on one host, so an fp32 plain version is no oracle to 1e-5)
    xd = logits.double()
    if score_function == "softmax":
        s = torch.softmax(xd, -1) if pre else xd
        sel = torch.topk(s, K).indices
        vals = s.gather(1, sel) if pre else torch.softmax(xd.gather(1, sel), -1)
    else:
        a = torch.sigmoid(xd) if score_function == "sigmoid" else torch.sqrt(torch.nn.functional.softplus(xd))
        sel = torch.topk(a + bias.double(), K).indices
        vals = a.gather(1, sel)
        vals = vals / (vals.sum(-1, keepdim=True) + 1e-20)
    exp = torch.zeros_like(xd).scatter(1, sel, 1.5 * vals)
    torch.testing.assert_close(probs.detach().double(), exp, rtol=1e-5, atol=1e-6)
    assert torch.equal(rmap, exp != 0)
    # gradient through both
    g = torch.randn(T, E, generator=gen).to(device)
    (gl,) = torch.autograd.grad(probs, lg, g)
    l2 = logits.clone().requires_grad_()
    p2, _ = moe_rt.torch.topk_with_score(l2, K, score_function=score_function, use_pre_softmax=pre,
                                         scaling_factor=1.5, expert_bias=bias)
    (g2,) = torch.autograd.grad(p2, l2, g)
    assert torch.equal(gl, g2)


def test_topk_groups_and_leading_dims():
    gen = _gen(2)
    logits = torch.randn(3, 5, 64, generator=gen)
    p, m = te.fused_topk_with_score_function(logits, 8, False, 8, 4, None, "sigmoid", None)
    cp, cm, _ = moe_rt.topk_with_score(logits, 8, score_function="sigmoid", num_groups=8, group_topk=4)
    assert p.shape == (3, 5, 64) and torch.equal(p, cp) and torch.equal(m, cm)
    # num_groups/group_topk <= 0 mean off, like None
    p0, _ = te.fused_topk_with_score_function(logits, 8, False, -1, -1, None, "sigmoid", None)
    pn, _ = te.fused_topk_with_score_function(logits, 8, False, None, None, None, "sigmoid", None)
    assert torch.equal(p0, pn)


def test_aux_scores_order_and_loss():
    gen = _gen(3)
    T, E, K, coeff = 40, 16, 4, 0.01
    logits = torch.randn(T, E, generator=gen, dtype=torch.bfloat16)
    rmap, scores = te.fused_compute_score_for_moe_aux_loss(logits, K, "softmax")
    assert rmap.dtype == torch.bool and scores.dtype == torch.float32
    cs, cm, _ = moe_rt.scores_for_aux_loss(logits, K, "softmax")
    assert torch.equal(scores, cs) and torch.equal(rmap, cm)
    probs = torch.rand(T, 2 * E, generator=gen).requires_grad_()  # seq-level: columns a multiple of E
    tpe = torch.randint(1, 100, (2 * E,), generator=gen, dtype=torch.int32)
    for total in (T, torch.tensor(T, dtype=torch.int64)):
        loss = te.fused_moe_aux_loss(probs, tpe, total, E, K, coeff)
        exp = (E * coeff / (K * T * T)) * (probs.detach().sum(0) * tpe).sum()
        torch.testing.assert_close(loss.detach(), exp, rtol=5.12e-5, atol=5.12e-5)
        (g,) = torch.autograd.grad(loss, probs)
        torch.testing.assert_close(g, (E * coeff / (K * T * T) * tpe.float()).expand(T, -1), rtol=1e-6, atol=0)


def test_router_bad_input():
    logits = torch.randn(8, 16)
    args = (logits, 2, False, None, None, None, "sigmoid", None)
    with pytest.raises(ValueError, match="float64"):
        te.fused_topk_with_score_function(logits.double(), *args[1:])
    with pytest.raises(ValueError, match="routing_map_format"):
        te.fused_topk_with_score_function(*args, routing_map_format="BITMAP")
    with pytest.raises(ValueError, match="routing_map_format"):
        te.fused_topk_with_score_function(*args, routing_map_format=3)
    with pytest.raises(TypeError, match="routing_map_format"):
        te.fused_topk_with_score_function(*args, routing_map_format=1.0)
    with pytest.raises(ValueError, match="topk_indices"):  # tests/test_router_formats.py: the features
        te.fused_topk_with_score_function(*args, routing_map_format="bitmap_u8",
                                          topk_indices=torch.empty(8, 2, dtype=torch.int32))
    hist, bounds = torch.zeros(16, 10, dtype=torch.int32), torch.tensor([-1.0, 1.0])
    with pytest.raises(ValueError, match="together"):
        te.fused_topk_with_score_function(*args, qb_histogram=hist)
    with pytest.raises(ValueError, match="expert_bias"):
        te.fused_topk_with_score_function(*args, qb_histogram=hist, qb_bin_bounds=bounds,
                                          qb_histogram_mode="fused_atomic")
    with pytest.raises(ValueError, match="sigmoid"):
        te.fused_topk_with_score_function(logits, 2, False, None, None, None, "softmax", None, qb_histogram=hist,
                                          qb_bin_bounds=bounds, qb_histogram_mode="fused_atomic")
    # Quantile Balancing runs (tests/test_router_qb.py covers it)
    te.fused_topk_with_score_function(logits, 2, False, None, None, None, "sigmoid", torch.zeros(16),
                                      qb_histogram=hist, qb_bin_bounds=bounds, qb_histogram_mode="two_kernel")
    assert int(hist.sum()) == 8 * 16
    with pytest.raises(ValueError, match="score_function"):
        te.fused_topk_with_score_function(logits, 2, False, None, None, None, "relu", None)


# -- permutation -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_mask_against_plain(device, dtype):
    gen = _gen(4)
    T, E, K, H = 97, 7, 2, 48
    num_out = 150  # TE's style: a map with exactly num_out ones
    m = _mask(T, E, K, gen, device, num_out)
    x = torch.randn(T, H, generator=gen).to(device, dtype).requires_grad_()
    out, row_id_map = te.moe_permute(x, m, num_out)
    exp, _, e, t = plain_permute_mask(x.detach(), m)
    assert torch.equal(out.detach(), exp)
    # the row_id_map format: n in column 2E, then destinations descending with their experts
    assert row_id_map.dtype == torch.int32 and row_id_map.shape == (T, 2 * E + 1)
    n = row_id_map[:, 2 * E]
    assert torch.equal(n, m.sum(1).int())
    dest = torch.full((T, E), -1, dtype=torch.int32, device=device)
    dest[t, e] = torch.arange(t.numel(), dtype=torch.int32, device=device)
    for tok in range(T):
        k = int(n[tok])
        rows = row_id_map[tok, :k]
        assert torch.all(rows[:-1] > rows[1:]) if k > 1 else True
        assert torch.equal(dest[tok, row_id_map[tok, E:E + k].long()], rows)
    # unpermute: weighted sum, fp32 accumulation; gradient to inp and merging_probs
    w = (torch.rand(T, E, generator=gen).to(device) * m).requires_grad_()
    y = te.moe_unpermute(out, row_id_map, w, restore_shape=(T, H))
    w2 = w.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y2 = plain_unpermute(x2[t], e, t, T, w2)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, y2, **tol)
    gy = torch.randn(T, H, generator=gen).to(device, dtype)
    gx, gw = torch.autograd.grad(y, [x, w], gy)
    gx2, gw2 = torch.autograd.grad(y2, [x2, w2], gy)
    torch.testing.assert_close(gx, gx2, **tol)
    assert gw.dtype == w.dtype
    torch.testing.assert_close(gw * m, gw2 * m, **(dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else tol))
    # 1/n weights bring the tokens back
    inv = m.float() / m.sum(1, keepdim=True).clamp(min=1)
    back = te.moe_unpermute(out.detach().float(), row_id_map, inv, restore_shape=(T, H))
    routed = m.any(1)
    torch.testing.assert_close(back[routed], x.detach().float()[routed], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_permute_same_bits_as_core(device):
    gen = _gen(5)
    T, E, K, H = 64, 9, 3, 33
    m = _mask(T, E, K, gen, device)
    x = torch.randn(T, H, generator=gen).to(device)
    probs = torch.rand(T, E, generator=gen).to(device)
    out, pp, _ = te.moe_permute_with_probs(x, probs, m, T * K)
    plan = moe_rt.make_plan(m, E, num_out_tokens=T * K)
    cx, cp = moe_rt.dispatch(x, plan, probs)
    assert torch.equal(out, cx) and torch.equal(pp, cp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
def test_permute_with_probs(device, pdtype):
    gen = _gen(6)
    T, E, K, H = 50, 6, 2, 16
    m = _mask(T, E, K, gen, device)
    x = torch.randn(T, H, generator=gen).to(device).requires_grad_()
    probs = (torch.rand(T, E, generator=gen) * 0.9 + 0.1).to(device, pdtype)
    probs[3][m[3]] = 0.0  # a routed prob of exactly 0.0 writes a zero row
    probs = probs.requires_grad_()
    out, pp, rid = te.moe_permute_with_probs(x, probs, m, int(m.sum()))
    exp, exp_pp, e, t = plain_permute_mask(x.detach(), m, probs.detach())
    exp = torch.where((exp_pp != 0)[:, None], exp, torch.zeros(()))
    assert pp.dtype == pdtype
    assert torch.equal(out.detach(), exp) and torch.equal(pp.detach(), exp_pp)
    gout = torch.randn(out.shape, generator=gen).to(device)
    gpp = torch.randn(pp.shape, generator=gen).to(device, pdtype)
    gx, gp = torch.autograd.grad([out, pp], [x, probs], [gout, gpp])
    # TE's backward: the input gradient sums every routed row (zero-prob rows too); probs get theirs
    torch.testing.assert_close(gx, torch.zeros(T, H, device=device).index_add(0, t, gout), rtol=1e-6, atol=1e-6)
    exp_gp = torch.zeros(T, E, device=device, dtype=pdtype)
    exp_gp[t, e] = gpp
    assert torch.equal(gp, exp_gp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("align", [8, 16])
def test_permute_and_pad(device, align):
    gen = _gen(7)
    T, E, K, H = 123, 8, 2, 20
    m = _mask(T, E, K, gen, device)
    x = torch.randn(T, H, generator=gen).to(device)
    probs = (torch.rand(T, E, generator=gen) + 0.1).to(device)
    tpe = m.sum(0)
    out, pp, rid, pad_offsets, target = te.moe_permute_and_pad_with_probs(x, probs, m, tpe, align)
    exp_target = (tpe + align - 1) // align * align
    assert target.dtype == torch.int64 and torch.equal(target, exp_target)
    assert out.shape == (int(exp_target.sum()), H)
    pad = exp_target - tpe
    assert torch.equal(pad_offsets, torch.cumsum(pad, 0) - pad)
    # plain: each expert's rows, then zero rows up to its target
    rows_e, probs_e = [], []
    for ex in range(E):
        tok = torch.nonzero(m[:, ex])[:, 0]
        rows_e += [x[tok], torch.zeros(int(pad[ex]), H, device=device)]
        probs_e += [probs[tok, ex], torch.zeros(int(pad[ex]), device=device)]
    assert torch.equal(out, torch.cat(rows_e)) and torch.equal(pp, torch.cat(probs_e))
    # the unpadded map plus pad_offsets unpermutes
    y = te.moe_unpermute(out, rid, probs, restore_shape=(T, H), pad_offsets=pad_offsets)
    _, _, e, t = plain_permute_mask(x, m)
    torch.testing.assert_close(y, plain_unpermute(x[t], e, t, T, probs), rtol=1e-5, atol=1e-5)
    # nothing to pad: pad_offsets is None
    m1 = torch.zeros(T, E, dtype=torch.bool, device=device)
    m1[: 4 * align, 0] = True
    r = te.moe_permute_and_pad_with_probs(x, probs, m1, m1.sum(0), align)
    assert r[3] is None and r[0].shape == (4 * align, H)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_out", [0, 100])
def test_permute_index(device, num_out):
    gen = _gen(8)
    T, E, K, H = 61, 10, 3, 12
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).int().to(device)
    x = torch.randn(T, H, generator=gen).to(device).requires_grad_()
    out, rid = te.moe_permute(x, idx, num_out, map_type="index")
    n = num_out or T * K
    exp, exp_rid = plain_permute_index(x.detach(), idx, n)
    assert torch.equal(out.detach(), exp) and torch.equal(rid, exp_rid) and rid.dtype == torch.int32
    # the same with num_experts given (no host read)
    out2, rid2 = te.moe_permute(x.detach(), idx, num_out, map_type="index", num_experts=E)
    assert torch.equal(out2, exp) and torch.equal(rid2, exp_rid)
    w = torch.rand(T, K, generator=gen).to(device).requires_grad_()
    y = te.moe_unpermute(out, rid, w, map_type="index")
    kept = (exp_rid.view(K, T).t() >= 0).float()
    y2 = (x.detach()[:, None, :] * (w.detach() * kept)[..., None]).sum(1)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-5)
    gy = torch.randn(T, H, generator=gen).to(device)
    gx, gw = torch.autograd.grad(y, [x, w], gy)
    assert gw.dtype == torch.float32
    torch.testing.assert_close(gx, gy * (w.detach() * kept).sum(1, keepdim=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, (gy @ x.detach().t()).diagonal()[:, None] * kept, rtol=1e-4, atol=1e-5)
    with pytest.warns(UserWarning, match="int32"):
        te.moe_permute(x.detach(), idx.long(), num_out, map_type="index")
    with pytest.warns(UserWarning, match="float32"):
        te.moe_unpermute(out.detach(), rid, w.detach().double(), map_type="index")


@pytest.mark.parametrize("device", DEVICES)
def test_sort_chunks(device):
    gen = _gen(9)
    N, H = 70, 8
    split = torch.tensor([10, 0, 25, 35], dtype=torch.int32, device=device)
    order = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=device)
    x = torch.randn(N, H, generator=gen).to(device).requires_grad_()
    probs = torch.rand(N, generator=gen).to(device, torch.bfloat16).requires_grad_()
    chunks = torch.split(x.detach(), split.tolist())
    exp = torch.cat([chunks[i] for i in order.tolist()])
    out = te.moe_sort_chunks_by_index(x, split, order)
    assert isinstance(out, torch.Tensor) and torch.equal(out.detach(), exp)
    out, pp = te.moe_sort_chunks_by_index_with_probs(x, probs, split, order)
    pchunks = torch.split(probs.detach(), split.tolist())
    assert pp.dtype == torch.bfloat16 and torch.equal(pp.detach(), torch.cat([pchunks[i] for i in order.tolist()]))
    gx, gp = torch.autograd.grad([out, pp], [x, probs], [out.detach() * 2, pp.detach()])
    torch.testing.assert_close(gx, 2 * x.detach())
    assert torch.equal(gp, probs.detach())


def test_compiled_permute_unpermute():
    gen = _gen(10)
    T, E, K, H = 33, 5, 2, 16
    m = _mask(T, E, K, gen, "cpu")
    x = torch.randn(T, H, generator=gen)
    probs = torch.rand(T, E, generator=gen)

    def layer(x, probs):
        out, pp, rid = te.moe_permute_with_probs(x, probs, m, T * K)
        return te.moe_unpermute(out * 2, rid, probs, restore_shape=(T, H)), pp

    eager = layer(x, probs)
    compiled = torch.compile(layer, fullgraph=True)(x, probs)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_permutation_bad_input():
    x, m = torch.randn(4, 8), torch.ones(4, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="map_type"):
        te.moe_permute(x, m, 4, map_type="dense")
    with pytest.raises(ValueError, match="num_out_tokens"):
        te.moe_permute(x, m, 0)
    with pytest.raises(ValueError, match="num_out_tokens"):
        te.moe_permute(x, torch.zeros(4, 2, dtype=torch.int32), -1, map_type="index")
    with pytest.raises(ValueError, match="tokens_per_expert"):
        te.moe_permute_and_pad_with_probs(x, torch.rand(4, 3), m, None, 8)
    with pytest.raises(ValueError, match="align_size"):
        te.moe_permute_and_pad_with_probs(x, torch.rand(4, 3), m, m.sum(0), 0)
    out, rid = te.moe_permute(x, m, 12)
    with pytest.raises(ValueError, match="deprecated"):
        te.moe_unpermute(out, rid, torch.rand(4, 3), probs=torch.rand(4, 3))
    with pytest.warns(UserWarning, match="deprecated"):
        te.moe_unpermute(out, rid, probs=torch.rand(4, 3), restore_shape=(4, 8))
    with pytest.raises(ValueError, match="restore_shape"):
        te.moe_unpermute(out, rid)  # restore_shape defaults to inp.shape: 12 rows, the map has 4 tokens
    # T = 0 passes through
    o, r = te.moe_permute(torch.empty(0, 8), torch.empty(0, 3, dtype=torch.bool), 0)
    assert o.shape == (0, 8) and r.shape == (0, 7)


# -- JAX --------------------------------------------------------------------------------------------------

def _jax(device):
    jax = pytest.importorskip("jax")
    tj = pytest.importorskip("moe_rt.te_jax")
    return jax, jax.numpy, tj, jax.devices("gpu" if device == "cuda" else "cpu")[0]


@pytest.mark.parametrize("device", DEVICES)
def test_jax_router(device):
    jax, jnp, tj, dev = _jax(device)
    rng = np.random.default_rng(11)
    logits = jax.device_put(jnp.asarray(rng.permutation(2 * 7 * 64).reshape(2, 7, 64).astype(np.float32) * 1e-3),
                            dev)
    host = np.asarray(logits)

    def core(*args, **kw):
        """The core op on the test's device (on CUDA the same kernel as the adapter: the same bits)."""
        if device == "cpu":
            return moe_rt.topk_with_score(host, *args, **kw)
        import cupy

        return tuple(cupy.asnumpy(a) for a in moe_rt.topk_with_score(cupy.asarray(host), *args, **kw))

    probs, rmap = jax.jit(lambda l: tj.fused_topk_with_score_function(l, 4))(logits)  # TE's defaults
    cp, cm, _ = core(4)
    assert probs.shape == (2, 7, 64) and np.array_equal(np.asarray(probs), cp) and np.array_equal(np.asarray(rmap), cm)
    rp, rm, _ = moe_rt.topk_with_score(host, 4)  # and the NumPy reference, to rounding
    np.testing.assert_allclose(np.asarray(probs), rp, rtol=1e-5, atol=1e-7)
    assert np.array_equal(np.asarray(rmap), rm)
    for f in (lambda l: tj.fused_topk_with_score_function(l, 8, num_groups=8, group_topk=4, score_function="sigmoid",
                                                          scaling_factor=2),
              lambda l: tj.fused_topk_with_score_function(l, 8, score_function="sqrtsoftplus",
                                                          expert_bias=jnp.linspace(-0.1, 0.1, 64))):
        p, m = f(logits)
        assert p.dtype == logits.dtype and m.dtype == jnp.bool_
    p, _ = tj.fused_topk_with_score_function(logits, 8, num_groups=8, group_topk=4, score_function="sigmoid")
    cp, _, _ = core(8, score_function="sigmoid", num_groups=8, group_topk=4)
    assert np.array_equal(np.asarray(p), cp)
    # compute_aux_scores: the dense scores (sigmoid normalized), bias/groups/scaling ignored
    s, m = tj.fused_topk_with_score_function(logits, 4, num_groups=8, group_topk=4, scaling_factor=3.0,
                                             score_function=tj.ScoreFunction.SIGMOID, compute_aux_scores=True)
    sig = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    np.testing.assert_allclose(np.asarray(s), sig / (sig.sum(-1, keepdims=True) + 1e-20), rtol=1e-5)
    g = jax.grad(lambda l: (tj.fused_topk_with_score_function(l, 4)[0] * jnp.arange(64.0)).sum())(logits)
    assert g.shape == logits.shape
    # the aux loss takes T and E from the probs' shape
    pr = jax.device_put(jnp.asarray(rng.random((40, 16)).astype(np.float32)), dev)
    tpe = jax.device_put(jnp.asarray(rng.integers(1, 50, 16).astype(np.int32)), dev)
    loss = tj.fused_moe_aux_loss(pr, tpe, 4, 0.01)
    exp = 16 * 0.01 / (4 * 40 * 40) * float((np.asarray(pr).sum(0) * np.asarray(tpe)).sum())
    assert float(loss) == pytest.approx(exp, rel=1e-5)


def test_jax_router_bad_input():
    jax, jnp, tj, _ = _jax("cpu")
    logits = jnp.ones((4, 8))
    with pytest.raises(TypeError, match="scaling_factor"):
        tj.fused_topk_with_score_function(logits, 2, scaling_factor=jnp.float32(1.0))
    with pytest.raises(ValueError, match="expert_bias"):
        tj.fused_topk_with_score_function(logits, 2, expert_bias=jnp.zeros(8))
    with pytest.raises(ValueError, match="routing_map_format"):
        tj.fused_topk_with_score_function(logits, 2, routing_map_format="packed")
    _, bitmap = tj.fused_topk_with_score_function(logits, 2, routing_map_format="BITMAP_U8")
    assert bitmap.shape == (4, 1) and bitmap.dtype == jnp.uint8
    with pytest.raises(ValueError, match="score_function"):
        tj.fused_topk_with_score_function(logits, 2, score_function="relu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("align", [None, 8])
def test_jax_token_dispatch_combine(device, align):
    jax, jnp, tj, dev = _jax(device)
    rng = np.random.default_rng(12)
    B, S, E, K, H = 3, 17, 5, 2, 24
    T = B * S
    m = np.zeros((T, E), np.int32)
    for t in range(T):
        m[t, rng.choice(E, K, replace=False)] = 1
    num_out = int(m.sum())
    x = rng.standard_normal((B, S, H)).astype(np.float32)
    probs = (rng.random((T, E)).astype(np.float32) * 0.9 + 0.1) * m
    jx, jm, jp = (jax.device_put(jnp.asarray(a), dev) for a in (x, m.reshape(B, S, E), probs.reshape(B, S, E)))
    f = jax.jit(lambda a, r, p: tj.token_dispatch(a, r, num_out, p, align))
    out, pp, rid, pad_offsets, tpe = f(jx, jm, jp)
    counts = m.sum(0)
    A = align or 1
    target = -(-counts // A) * A
    rows = (num_out + E * (A - 1)) // A * A
    assert out.shape == (rows, H) and pp.shape == (rows,) and pp.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(tpe), target if align else counts)
    assert tpe.dtype == jnp.int32
    if align is None:
        assert pad_offsets is None
    else:
        pad = target - counts
        np.testing.assert_array_equal(np.asarray(pad_offsets), np.cumsum(pad) - pad)
    # plain: expert-major, token-ascending, zero rows after each expert's tokens up to its target
    xf = x.reshape(T, H)
    exp = np.zeros((rows, H), np.float32)
    exp_p = np.zeros(rows, np.float32)
    r = 0
    for e in range(E):
        tok = np.nonzero(m[:, e])[0]
        exp[r:r + tok.size], exp_p[r:r + tok.size] = xf[tok], probs[tok, e]
        r += target[e] if align else tok.size
    np.testing.assert_array_equal(np.asarray(out), exp)
    np.testing.assert_array_equal(np.asarray(pp), exp_p)
    np.testing.assert_array_equal(np.asarray(rid)[:, 2 * E], m.sum(1))
    # dispatch then combine with 1/n weights gives the input back
    inv = jnp.asarray(m / m.sum(1, keepdims=True).clip(1), jnp.float32)
    back = jax.jit(lambda o, r_, w, po: tj.token_combine(o, r_, w, po))(out, rid, inv, pad_offsets)
    np.testing.assert_allclose(np.asarray(back), xf, rtol=1e-6, atol=1e-6)
    # gradients against a plain jnp layer
    w = jnp.asarray(rng.standard_normal((T, H)).astype(np.float32))

    def ours(a, p):
        o, pp_, r_, po, _ = tj.token_dispatch(a, jm, num_out, p, align)
        return (tj.token_combine(o * pp_[:, None], r_, None, po) * w).sum()

    def plain(a, p):
        return ((a.reshape(T, H) * (p.reshape(T, E) * m).sum(1)[:, None]) * w).sum()

    v1, g1 = jax.value_and_grad(ours, argnums=(0, 1))(jx, jp)
    v2, g2 = jax.value_and_grad(plain, argnums=(0, 1))(jx, jp)
    np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g1[0]), np.asarray(g2[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g1[1]) * m.reshape(B, S, E), np.asarray(g2[1]), rtol=1e-5, atol=1e-5)


def test_jax_dispatch_bad_input():
    jax, jnp, tj, _ = _jax("cpu")
    x, m = jnp.ones((4, 8)), jnp.ones((4, 3), jnp.int32)
    with pytest.raises(ValueError, match="num_out_tokens"):
        tj.token_dispatch(x, m, -1)
    with pytest.raises(ValueError, match="num_out_tokens"):
        tj.token_dispatch(x, m, 0)
    with pytest.raises(ValueError, match="align_size"):
        tj.token_dispatch(x, m, 12, align_size=0)


@pytest.mark.parametrize("device", DEVICES)
def test_jax_sort_chunks_by_index(device):
    jax, jnp, tj, dev = _jax(device)
    from moe_rt.reference import permutation as RP

    rng = np.random.default_rng(13)
    N, H = 40, 6
    split, order = np.array([4, 0, 17, 15], np.int32), np.array([3, 1, 0, 2], np.int32)
    x = jax.device_put(jnp.asarray(rng.standard_normal((N, H)).astype(np.float32)), dev)
    out, rid = jax.jit(tj.sort_chunks_by_index)(x, jnp.asarray(split), jnp.asarray(order))
    exp_map = RP.chunk_sort_map(N, split, order)
    np.testing.assert_array_equal(np.asarray(rid), exp_map)
    assert rid.dtype == jnp.int32
    exp = np.empty((N, H), np.float32)
    exp[exp_map] = np.asarray(x)
    np.testing.assert_array_equal(np.asarray(out), exp)
    g = jax.grad(lambda a: (tj.sort_chunks_by_index(a, split, order)[0] * jnp.arange(N * H).reshape(N, H)
                            ).sum())(x)
    np.testing.assert_array_equal(np.asarray(g), np.arange(N * H).reshape(N, H)[exp_map].astype(np.float32))
