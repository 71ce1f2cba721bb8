"""moe_rt.torch: autograd and torch.compile over the moe_rt ops, checked against the same layer written
in plain torch. CPU tensors run the NumPy reference behind the same custom ops; CUDA tensors the kernels."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("moe_rt.torch")

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _routing(T, E, K, gen, device):
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).int()
    idx[::5, -1] = -1  # some slots route nowhere
    return idx.to(device)


def _plain_permute_combine(x, probs, idx, scale):
    """dispatch -> (scale * rows) -> weighted combine, in plain torch (no permutation needed for the math)."""
    valid = (idx >= 0).to(probs.dtype)
    w = probs * valid
    y = (scale * x[:, None, :].float() * w[..., None].float()).sum(1).to(x.dtype)
    return y, w


def _ours(x, probs, idx, E, scale, align_size):
    plan = mt.make_plan(idx, E, align_size=align_size)
    xp, pp = mt.dispatch(x, plan, probs)
    y = mt.combine(xp * scale, plan, probs)
    return y, pp, plan


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("align_size", [1, 4])
def test_dispatch_combine_autograd_matches_plain_torch(device, dtype, align_size):
    gen = torch.Generator().manual_seed(7)
    T, E, K, H = 37, 6, 3, 40
    idx = _routing(T, E, K, gen, device)
    x = torch.randn(T, H, generator=gen).to(device, dtype).requires_grad_()
    probs = torch.rand(T, K, generator=gen).to(device).requires_grad_()
    gy = torch.randn(T, H, generator=gen).to(device, dtype)
    gpp = None

    y, pp, plan = _ours(x, probs, idx, E, 2.0, align_size)
    assert plan.num_rows >= (idx >= 0).sum().item()
    assert pp.shape == (plan.num_rows,)
    gpp = torch.randn(pp.shape, generator=gen).to(device)
    gx, gp = torch.autograd.grad([y, pp], [x, probs], [gy, gpp])

    x2 = x.detach().clone().requires_grad_()
    p2 = probs.detach().clone().requires_grad_()
    y2, w2 = _plain_permute_combine(x2, p2, idx, 2.0)
    # probs_permuted holds each kept slot's prob once: its gradient reaches probs[t,k] directly
    dst = plan.dst_row.long()
    gpp_slots = torch.where(dst >= 0, gpp[dst.clamp(min=0)], torch.zeros((), device=device))
    gx2, gp2 = torch.autograd.grad([y2, (w2 * gpp_slots).sum()], [x2, p2], [gy, None])

    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, y2, **tol)
    torch.testing.assert_close(gx, gx2, **tol)
    torch.testing.assert_close(gp, gp2, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_compiles_without_graph_breaks(device):
    gen = torch.Generator().manual_seed(3)
    T, E, K, H = 16, 4, 2, 8
    idx = _routing(T, E, K, gen, device)
    x = torch.randn(T, H, generator=gen).to(device).requires_grad_()
    probs = torch.rand(T, K, generator=gen).to(device).requires_grad_()

    def f(x, probs):
        y, pp, _ = _ours(x, probs, idx, E, 1.5, 1)
        return (y * y).sum() + pp.sum()

    explanation = torch._dynamo.explain(f)(x, probs)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(f, fullgraph=True)
    g = torch.autograd.grad(compiled(x, probs), [x, probs])
    g_ref = torch.autograd.grad(f(x, probs), [x, probs])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


def test_plan_type_is_checked():
    x = torch.zeros(2, 4)
    with pytest.raises(TypeError, match="plan: expected a TorchPlan"):
        mt.dispatch(x, object())
    with pytest.raises(ValueError, match="routing: expected a 2-D array"):
        mt.make_plan(torch.zeros(3, dtype=torch.int32), 4)


# -- router ----------------------------------------------------------------------------------------------

def _plain_topk(l, K, sf, pre, scale):
    if sf == "softmax":
        if pre:
            a = torch.softmax(l, -1)
            v, i = a.topk(K)
            return torch.zeros_like(a).scatter(1, i, v) * scale
        v, i = l.topk(K)
        return torch.zeros_like(l).scatter(1, i, torch.softmax(v, -1)) * scale
    a = torch.sigmoid(l) if sf == "sigmoid" else torch.nn.functional.softplus(l).sqrt()
    v, i = a.topk(K)
    v = v / (v.sum(-1, keepdim=True) + 1e-20) if K > 1 else v
    return torch.zeros_like(a).scatter(1, i, v) * scale


def _tie_free_logits(T, E, gen, device):
    ramp = torch.arange(E, dtype=torch.float32) * (1e-3 / E)
    return (torch.randn(T, E, generator=gen) + ramp).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sf,pre", [("softmax", False), ("softmax", True), ("sigmoid", False),
                                    ("sqrtsoftplus", False)])
def test_topk_with_score_autograd_matches_plain_torch(device, sf, pre):
    gen = torch.Generator().manual_seed(11)
    T, E, K = 29, 16, 4
    logits = _tie_free_logits(T, E, gen, device).requires_grad_()
    gp = torch.randn(T, E, generator=gen).to(device)
    probs, rmap = mt.topk_with_score(logits, K, score_function=sf, use_pre_softmax=pre, scaling_factor=1.5)
    (g,) = torch.autograd.grad((probs * gp).sum(), logits)
    l2 = logits.detach().clone().requires_grad_()
    p2 = _plain_topk(l2, K, sf, pre, 1.5)
    (g2,) = torch.autograd.grad((p2 * gp).sum(), l2)
    assert torch.equal(rmap, p2 != 0)
    torch.testing.assert_close(probs, p2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, g2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", [{}, dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.0),
                                dict(score_function="sigmoid", use_pre_softmax=False, scaling_factor=None)])
def test_topk_keywords_and_bias_reach_the_op(device, kw, monkeypatch):
    """The eager top-k passes moe_rt only the keywords that differ from its defaults; with the expert bias
    or without, its values and gradients are the custom op's (the path torch.compile traces), bitwise."""
    gen = torch.Generator().manual_seed(17)
    T, E, K = 21, 16, 4
    l0 = _tie_free_logits(T, E, gen, device)
    bias = (torch.rand(E, generator=gen) * 0.1).to(device)
    gp = torch.randn(T, E, generator=gen).to(device)
    for b in (None, bias):
        if b is not None and kw.get("score_function", "softmax") == "softmax":
            continue  # the bias applies to sigmoid and sqrtsoftplus scores
        got = []
        for compiling in (False, True):
            monkeypatch.setattr(mt, "_is_compiling", lambda c=compiling: c)
            logits = l0.clone().requires_grad_()
            probs, rmap = mt.topk_with_score(logits, K, expert_bias=b, **kw)
            (g,) = torch.autograd.grad((probs * gp).sum(), logits)
            got.append((probs.detach(), rmap, g))
        for a, c in zip(*got):
            assert torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
def test_router_aux_path_autograd_and_compile(device):
    gen = torch.Generator().manual_seed(5)
    T, E, K = 33, 8, 2
    logits = _tie_free_logits(T, E, gen, device).requires_grad_()
    gp = torch.randn(T, E, generator=gen).to(device)

    def ours(l):
        probs, _ = mt.topk_with_score(l, K, score_function="sigmoid", num_groups=4, group_topk=2)
        s, m = mt.scores_for_aux_loss(l, K, "softmax")
        loss = mt.aux_loss(s, m.sum(0).int(), T, E, K, 0.01)
        assert loss.shape == ()
        return (probs * gp).sum() + loss

    def plain_aux(l):
        s = torch.softmax(l, -1)
        _, i = s.topk(K)
        tpe = torch.zeros_like(s).scatter(1, i, 1.0).sum(0)
        return (E * 0.01) / K / T / T * (s.sum(0) * tpe).sum()

    (g,) = torch.autograd.grad(ours(logits) - (mt.topk_with_score(logits, K, score_function="sigmoid",
                                                                     num_groups=4, group_topk=2)[0] * gp).sum(),
                               logits)
    (g2,) = torch.autograd.grad(plain_aux(logits), logits)
    torch.testing.assert_close(g, g2, rtol=1e-5, atol=1e-7)
    assert torch._dynamo.explain(ours)(logits).graph_break_count == 0
    compiled = torch.compile(ours, fullgraph=True)
    (gc,) = torch.autograd.grad(compiled(logits), logits)
    (ge,) = torch.autograd.grad(ours(logits), logits)
    torch.testing.assert_close(gc, ge)


# -- eager path and custom-op path ----------------------------------------------------------------------

def _layer(x, probs, logits, idx, E, K, gp):
    plan = mt.make_plan(idx, E, align_size=4)
    xp, pp = mt.dispatch(x, plan, probs)
    y = mt.combine(xp * 1.5, plan, probs)
    p, _ = mt.topk_with_score(logits, K, score_function="sigmoid", num_groups=4, group_topk=2)
    s, m = mt.scores_for_aux_loss(logits, K, "softmax")
    loss = mt.aux_loss(s, m.sum(0).int(), logits.shape[0], E, K, 0.01)
    return (y.float() * 0.5).sum() + (pp * pp).sum() + (p * gp).sum() + loss, plan


@pytest.mark.parametrize("device", DEVICES)
def test_eager_path_matches_custom_op_path(device, monkeypatch):
    """Outside torch.compile the ops take a lean autograd.Function path (torch's C apply); the full
    Function.apply (taken under functorch transforms) and the custom ops (the path torch.compile traces)
    must give the same values and gradients, bitwise."""
    gen = torch.Generator().manual_seed(11)
    T, E, K, H = 37, 8, 2, 24
    idx = _routing(T, E, K, gen, device)
    x0 = torch.randn(T, H, generator=gen).to(device)
    p0 = torch.rand(T, K, generator=gen).to(device)
    l0 = _tie_free_logits(T, E, gen, device)
    gp = torch.randn(T, E, generator=gen).to(device)
    results = []
    for compiling, full_apply in ((False, False), (False, True), (True, False)):
        monkeypatch.setattr(mt, "_is_compiling", lambda c=compiling: c)
        monkeypatch.setattr(mt, "_functorch_active", lambda f=full_apply: f)
        x, probs, logits = (t.clone().requires_grad_() for t in (x0, p0, l0))
        loss, plan = _layer(x, probs, logits, idx, E, K, gp)
        assert isinstance(plan, mt.TorchPlan)
        grads = torch.autograd.grad(loss, [x, probs, logits])
        results.append((loss.detach(), plan[:5], grads))
    (la, pa, ga) = results[0]
    for lb, pb, gb in results[1:]:
        assert torch.equal(la, lb)
        for a, b in zip(pa + ga, pb + gb):
            assert torch.equal(a, b)


def test_functorch_grad_and_vjp_match_autograd():
    """torch.func.grad and torch.func.vjp run through the eager ops (setup_context Functions) and give the
    gradients eager autograd gives, for every differentiable op of a MoE layer; torch.vmap is refused with a
    NotImplementedError naming the op, as is a second derivative."""
    gen = torch.Generator().manual_seed(13)
    T, E, K, H = 9, 8, 2, 5
    logits = _tie_free_logits(T, E, gen, "cpu")
    x = torch.randn(T, H, generator=gen)
    w = torch.randn(H, H, generator=gen)

    def layer(lg, xx):
        probs, routing_map = mt.topk_with_score(lg, K, score_function="sigmoid")
        scores, _ = mt.scores_for_aux_loss(lg, K, "softmax")
        plan = mt.make_plan(routing_map, E)
        xp, pp = mt.dispatch(xx, plan, probs)
        y = mt.combine(xp @ w * pp[:, None], plan, probs)
        aux = mt.aux_loss(scores, plan.tokens_per_expert, T, E, K, 0.3)
        return (y * y).sum() + aux

    gl, gx = torch.func.grad(layer, argnums=(0, 1))(logits, x)
    la, xa = logits.clone().requires_grad_(), x.clone().requires_grad_()
    layer(la, xa).backward()
    assert torch.allclose(gl, la.grad, rtol=1e-5, atol=1e-6) and torch.allclose(gx, xa.grad, rtol=1e-5, atol=1e-6)
    assert gl.abs().sum() > 0 and gx.abs().sum() > 0

    out, vjp = torch.func.vjp(lambda lg: mt.topk_with_score(lg, K)[0], logits)
    ct = torch.randn(out.shape, generator=gen)
    (g,) = vjp(ct)
    lb = logits.clone().requires_grad_()
    torch.autograd.backward(mt.topk_with_score(lb, K)[0], ct)
    assert torch.equal(g, lb.grad)

    batch = torch.stack([logits, logits.flip(0)])
    with pytest.raises(NotImplementedError, match="topk_with_score.*vmap"):
        torch.vmap(lambda lg: mt.topk_with_score(lg, K)[0])(batch)
    with pytest.raises(NotImplementedError, match="make_plan.*vmap"):
        torch.vmap(lambda r: mt.make_plan(r, E).dst_row)(torch.stack([_routing(T, E, K, gen, "cpu")] * 2))
    with pytest.raises(NotImplementedError, match="higher-order"):
        torch.func.grad(lambda lg: torch.func.grad(lambda a: mt.topk_with_score(a, K)[0].pow(2).sum())(lg).sum())(
            logits)


def test_non_tensor_arguments_are_type_errors():
    """A NumPy array (or any non-tensor) given to a moe_rt.torch op is a TypeError naming the argument."""
    gen = torch.Generator().manual_seed(14)
    T, E, K, H = 5, 4, 2, 3
    idx = _routing(T, E, K, gen, "cpu")
    plan = mt.make_plan(idx, E)
    x = torch.randn(T, H, generator=gen)
    a = np.ones((T, E), np.float32)
    cases = [
        (lambda: mt.topk_with_score(a, K), "logits"),
        (lambda: mt.scores_for_aux_loss(a, K, "softmax"), "logits"),
        (lambda: mt.aux_loss(a, np.ones(E, np.int32), T, E, K, 0.1), "probs"),
        (lambda: mt.aux_loss(torch.ones(T, E), np.ones(E, np.int32), T, E, K, 0.1), "tokens_per_expert"),
        (lambda: mt.make_plan(idx.numpy(), E), "routing"),
        (lambda: mt.dispatch(x.numpy(), plan), "x"),
        (lambda: mt.dispatch(x, plan, np.ones((T, K), np.float32)), "probs"),
        (lambda: mt.combine(np.ones((plan.num_rows, H), np.float32), plan), "y_permuted"),
        (lambda: mt.topk_with_score(torch.ones(T, E), K, score_function="sigmoid",
                                    expert_bias=np.zeros(E, np.float32)), "expert_bias"),
    ]
    for f, name in cases:
        with pytest.raises(TypeError, match=f"{name}: expected a torch.Tensor"):
            f()


@pytest.mark.parametrize("device", DEVICES)
def test_eager_plan_rebuilt_or_swapped(device):
    """The eager ops remember the moe_rt plan behind a TorchPlan; a TorchPlan rebuilt from the same tensors
    reuses it, and one with a different tensor is rebuilt from its own tensors, never served a stale plan."""
    gen = torch.Generator().manual_seed(12)
    T, E, K, H = 19, 6, 2, 8
    x = torch.randn(T, H, generator=gen).to(device)
    idx_a = _routing(T, E, K, gen, device)
    idx_b = _routing(T, E, K, gen, device)
    pa, pb = mt.make_plan(idx_a, E), mt.make_plan(idx_b, E)
    want_a, _ = mt.dispatch(x, pa)
    want_b, _ = mt.dispatch(x, pb)
    assert torch.equal(mt.dispatch(x, mt.TorchPlan(*pa))[0], want_a)
    copied = mt.TorchPlan(*(t.clone() for t in pb[:5]), *pb[5:])
    assert torch.equal(mt.dispatch(x, copied)[0], want_b)
    del pa
    import gc

    gc.collect()
    assert torch.equal(mt.dispatch(x, pb)[0], want_b)


def test_plan_views_split_from_one_buffer():
    """A CUDA plan keeps its five arrays back to back in one int32 buffer (maybe longer); the torch
    adapter hands them out as five views from one split. Checked on a CPU buffer laid out the same way:
    each view holds its array's values and shape and shares the buffer's memory, for two layouts and then
    the first layout again over a longer buffer (the split sizes are cached per layout and buffer length)."""
    from moe_rt import permutation as P

    gen = torch.Generator().manual_seed(21)
    specs = {}
    for T, E, K, extra in ((17, 6, 2, 5), (9, 4, 3, 0), (17, 6, 2, 7)):
        ref = P.make_plan(_routing(T, E, K, gen, "cpu"), E)
        arrays = [torch.as_tensor(getattr(ref, k)) for k in mt._PLAN_ARRAYS]
        spec, off = {}, 0
        for k, a in zip(mt._PLAN_ARRAYS, arrays):
            spec[k] = (off, tuple(a.shape))
            off += a.numel()
        spec = specs.setdefault(str(spec), spec)  # the third layout: the first's spec, a longer buffer
        buf = torch.full((off + extra,), -7, dtype=torch.int32)
        for k, a in zip(mt._PLAN_ARRAYS, arrays):
            buf[spec[k][0]:spec[k][0] + a.numel()] = a.reshape(-1)
        plan = P.Plan._blank()  # a CUDA plan's form: its arrays as views of one buffer
        for k in ("num_tokens", "topk", "num_experts", "num_rows", "align_size", "num_out_tokens", "from_routing_map"):
            setattr(plan, k, getattr(ref, k))
        plan.backend, plan.device_id = "cuda", 0
        views = P._PlanViews()
        views._buf, views._spec = buf, spec
        plan._v, plan._framework, plan._exported = views, "torch", {}
        tp = mt._torch_plan(plan, -1)
        assert (tp.num_experts, tp.num_rows, tp.align_size, tp.num_out_tokens) == (E, ref.num_rows, 1, -1)
        for k, a, t in zip(mt._PLAN_ARRAYS, arrays, tp[:5]):
            assert t.shape == a.shape and t.dtype == torch.int32, k
            assert torch.equal(t, a.to(torch.int32)), k
            assert t.data_ptr() == buf.data_ptr() + 4 * spec[k][0], k
        assert mt._plan_of(tp) is plan
