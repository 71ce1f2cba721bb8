"""What a user meets at the API's edges (issue 33): core ops never detach silently, backward ops validate
their flags as their forwards do and refuse settings the forward's outputs cannot have come from, moe_rt.jax
checks when it traces, and the small error cases name what is wrong. CPU tests run everywhere; the ``gpu``
twins check the CUDA paths (the torch replays included) behave the same."""
import numpy as np
import pytest

import moe_rt
from moe_rt import permutation as P
from moe_rt import router as R

torch = pytest.importorskip("torch")

F32 = np.float32
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]
T, E, K, H = 11, 8, 2, 6


def _logits(rng):
    """Tie-free logits: distinct values a row (a permutation of spaced levels plus small noise)."""
    base = np.stack([rng.permutation(E) for _ in range(T)]).astype(F32)
    return base + rng.uniform(-0.2, 0.2, (T, E)).astype(F32)


def _routing(rng):
    return np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)


def _t(a, device, grad=False):
    t = torch.from_numpy(np.ascontiguousarray(a)).to(device)
    return t.requires_grad_() if grad else t


def _core_calls(rng, device, grad):
    """(name, call) for each core op whose float inputs are torch tensors requiring grad when ``grad``."""
    lg = _logits(rng)
    idx = _t(_routing(rng), device)
    plan = moe_rt.make_plan(idx, E)
    p, m, inter = moe_rt.topk_with_score(_t(lg, device), K)
    x = _t(rng.standard_normal((T, H)).astype(F32), device, grad)
    w = _t(rng.random((T, K)).astype(F32), device, grad)
    y_p = _t(rng.standard_normal((plan.num_rows, H)).astype(F32), device, grad)
    logits = _t(lg, device, grad)
    tpe = plan.tokens_per_expert
    split = np.array([4, 3, 4], np.int32)
    order = np.array([2, 0, 1], np.int32)
    g_probs = _t(rng.standard_normal((T, E)).astype(F32), device, grad)
    return [
        ("topk_with_score", lambda: moe_rt.topk_with_score(logits, K)),
        ("topk_indices_with_score", lambda: moe_rt.topk_indices_with_score(logits, K)),
        ("topk_with_score_backward",
         lambda: moe_rt.topk_with_score_backward(g_probs, m, inter, K, score_function="softmax")),
        ("scores_for_aux_loss", lambda: moe_rt.scores_for_aux_loss(logits, K, "softmax")),
        ("scores_for_aux_loss_backward",
         lambda: moe_rt.scores_for_aux_loss_backward(g_probs, _t(np.full((T, E), 0.5, F32), device), K, "softmax")),
        ("aux_loss", lambda: moe_rt.aux_loss(logits, tpe, T, E, K, 0.1)),
        ("aux_loss_backward",
         lambda: moe_rt.aux_loss_backward(_t(np.array(1.0, F32), device, grad), T, tpe, T, E, K, 0.1)),
        ("dispatch", lambda: moe_rt.dispatch(x, plan, w)),
        ("combine", lambda: moe_rt.combine(y_p, plan, w)),
        ("dispatch_backward", lambda: moe_rt.dispatch_backward(y_p, plan)),
        ("combine_backward", lambda: moe_rt.combine_backward(x, plan, y_p.detach(), w)),
        ("sort_chunks", lambda: moe_rt.sort_chunks(x, split, order)),
        ("sort_chunks_backward", lambda: moe_rt.sort_chunks_backward(x, split, order)),
    ]


def _tensors(out):
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return [] if out is None else [out]


# ---- 1. no silent gradient loss --------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_core_ops_refuse_tensors_that_need_grad(device, rng):
    """A core op given a torch tensor that requires grad (grad mode on) raises a TypeError naming
    moe_rt.torch; the same call under torch.no_grad() or on detached tensors runs and gives the same
    result. On CUDA each op first runs once on plain tensors, so the refusal is checked where the replay of
    recorded launches would serve the call."""
    for name, call in _core_calls(np.random.default_rng(5), device, grad=False):
        call()
        call()  # a recorded signature: the next calls are replays on CUDA
    for name, call in _core_calls(np.random.default_rng(5), device, grad=True):
        with pytest.raises(TypeError, match="moe_rt.torch"):
            call()
        with torch.no_grad():
            got = call()
        want = dict(_core_calls(np.random.default_rng(5), device, grad=False))[name]()
        got, want = _tensors(got), _tensors(want)
        assert len(got) == len(want) > 0
        for a, b in zip(got, want):
            assert not a.requires_grad
            assert torch.equal(a, b), name


def test_ep_ops_refuse_tensors_that_need_grad(rng):
    g = moe_rt.EpGroup(None, E, H, 16)
    idx = torch.from_numpy(_routing(rng))
    h = g.prepare(idx)
    x = torch.randn(T, H, requires_grad=True)
    w = torch.rand(T, K, requires_grad=True)
    with pytest.raises(TypeError, match="moe_rt.torch"):
        g.dispatch(h, x, w)
    rx, rw, _ = g.dispatch(h, x.detach(), w.detach())
    y = rx.clone().requires_grad_()
    for call in (lambda: g.combine(h, y), lambda: g.dispatch_bwd(h, y),
                 lambda: g.combine_bwd(h, x, y.detach())):
        with pytest.raises(TypeError, match="moe_rt.torch"):
            call()
        with torch.no_grad():
            call()


def test_core_ops_refuse_jax_tracers(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    lg = jnp.asarray(_logits(rng))
    idx = jnp.asarray(_routing(rng))
    for f in (lambda a: moe_rt.topk_with_score(a, K)[0], lambda a: moe_rt.scores_for_aux_loss(a, K, "sigmoid")[0],
              lambda a: moe_rt.make_plan(idx + a[:, :K].astype(jnp.int32) * 0, E).dst_row):
        with pytest.raises(TypeError, match="moe_rt.jax"):
            jax.jit(f)(lg)
    with pytest.raises(TypeError, match="moe_rt.jax"):
        jax.grad(lambda a: moe_rt.aux_loss(a, np.ones(E, np.int32), T, E, K, 0.1))(lg)


# ---- 2. backward flags validated like the forward's ------------------------------------------------------

BAD_FLAGS = [
    (dict(use_pre_softmax="False"), TypeError, "use_pre_softmax"),
    (dict(use_pre_softmax=1), TypeError, "use_pre_softmax"),
    (dict(score_function=3), TypeError, "score_function"),
    (dict(score_function="relu"), ValueError, "score_function"),
    (dict(scaling_factor="2"), TypeError, "scaling_factor"),
    (dict(scaling_factor=float("nan")), ValueError, "scaling_factor"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw,err,name", BAD_FLAGS)
def test_topk_backward_validates_flags_like_forward(device, kw, err, name, rng):
    lg = _t(_logits(rng), device)
    p, m, inter = moe_rt.topk_with_score(lg, K)
    args = dict(score_function="softmax", use_pre_softmax=False, scaling_factor=None)
    args.update(kw)
    with pytest.raises(err, match=name):
        moe_rt.topk_with_score(lg, K, **args)
    with pytest.raises(err, match=name):
        moe_rt.topk_with_score_backward(torch.ones_like(p), m, inter, K, **args)
    for topk, terr in ((2.0, TypeError), (True, TypeError), (0, ValueError), (E + 1, ValueError)):
        with pytest.raises(terr, match="topk"):
            moe_rt.topk_with_score(lg, topk)
        with pytest.raises(terr, match="topk"):
            moe_rt.topk_with_score_backward(torch.ones_like(p), m, inter, topk, score_function="softmax")


@pytest.mark.parametrize("device", DEVICES)
def test_scores_and_aux_backward_validate_like_forward(device, rng):
    lg = _t(_logits(rng), device)
    s, m, inter = moe_rt.scores_for_aux_loss(lg, K, "softmax")
    for sf, err in ((3, TypeError), ("relu", ValueError), (None, TypeError)):
        with pytest.raises(err, match="score_function"):
            moe_rt.scores_for_aux_loss(lg, K, sf)
        with pytest.raises(err, match="score_function"):
            moe_rt.scores_for_aux_loss_backward(torch.ones_like(s), inter, K, sf)
    for topk, err in ((2.5, TypeError), (0, ValueError), (E + 1, ValueError)):
        with pytest.raises(err, match="topk"):
            moe_rt.scores_for_aux_loss(lg, topk, "softmax")
        with pytest.raises(err, match="topk"):
            moe_rt.scores_for_aux_loss_backward(torch.ones_like(s), inter, topk, "softmax")
    tpe = _t(np.full(E, 3, np.int32), device)
    g = _t(np.array(1.0, F32), device)
    good = dict(total_num_tokens=T, num_experts=E, topk=K, coeff=0.1)
    for kw, err, name in ((dict(coeff=float("inf")), ValueError, "coeff"), (dict(coeff="0.1"), TypeError, "coeff"),
                          (dict(topk=0), ValueError, "topk"), (dict(topk=1.0), TypeError, "topk"),
                          (dict(num_experts=3), ValueError, "num_experts"),
                          (dict(total_num_tokens=0), ValueError, "total_num_tokens")):
        a = dict(good, **kw)
        with pytest.raises(err, match=name):
            moe_rt.aux_loss(s, tpe, a["total_num_tokens"], a["num_experts"], a["topk"], a["coeff"])
        with pytest.raises(err, match=name):
            moe_rt.aux_loss_backward(g, T, tpe, a["total_num_tokens"], a["num_experts"], a["topk"], a["coeff"])


SETTINGS = [("softmax", False), ("softmax", True), ("sigmoid", False), ("sqrtsoftplus", False)]


@pytest.mark.parametrize("fwd", SETTINGS)
def test_topk_backward_refuses_settings_the_forward_did_not_use(fwd, rng):
    """CPU: a topk or score function the routing map and intermediate cannot have come from is a
    ValueError; the forward's own settings give the reference gradient."""
    lg = _logits(rng)
    sf, pre = fwd
    p, m, inter = moe_rt.topk_with_score(lg, K, score_function=sf, use_pre_softmax=pre)
    g = rng.standard_normal(p.shape).astype(F32)
    got = moe_rt.topk_with_score_backward(g, m, inter, K, score_function=sf, use_pre_softmax=pre)
    np.testing.assert_array_equal(got, R.ref.topk_with_score_bwd(g, m, inter, K, pre, 1.0, sf))
    with pytest.raises(ValueError, match="topk"):
        moe_rt.topk_with_score_backward(g, m, inter, K + 1, score_function=sf, use_pre_softmax=pre)
    # which other settings the intermediate rules out: post-softmax has -inf off the map; sigmoid and
    # pre-softmax lie in [0, 1]; pre-softmax rows sum to 1; sqrtsoftplus keeps raw logits (here > 1 somewhere)
    caught = {("softmax", False): [("softmax", True), ("sigmoid", False)],
              ("softmax", True): [("softmax", False)],
              ("sigmoid", False): [("softmax", False), ("softmax", True)],
              ("sqrtsoftplus", False): [("softmax", False), ("softmax", True), ("sigmoid", False)]}[fwd]
    for sf2, pre2 in caught:
        with pytest.raises(ValueError, match="score_function|use_pre_softmax"):
            moe_rt.topk_with_score_backward(g, m, inter, K, score_function=sf2, use_pre_softmax=pre2)


def test_scores_backward_refuses_an_intermediate_of_another_score_function(rng):
    lg = _logits(rng)
    _, _, inter = moe_rt.scores_for_aux_loss(lg, K, "sqrtsoftplus")  # raw logits, some above 1
    g = np.ones((T, E), F32)
    for sf in ("softmax", "sigmoid"):
        with pytest.raises(ValueError, match="score_function"):
            moe_rt.scores_for_aux_loss_backward(g, inter, K, sf)
    _, _, inter = moe_rt.scores_for_aux_loss(lg, K, "softmax")
    np.testing.assert_array_equal(moe_rt.scores_for_aux_loss_backward(g, inter, K, "softmax"),
                                  R.ref.scores_for_aux_loss_bwd(g, inter, K, "softmax"))


# ---- 3. moe_rt.jax checks when it traces --------------------------------------------------------------

def test_jax_adapters_raise_at_trace_time(rng):
    """Bad shapes, dtypes and flags raise the core op's TypeError/ValueError from the call while tracing
    (``jit(...).lower`` runs nothing), never a runtime error from inside a callback."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    mj = pytest.importorskip("moe_rt.jax")
    lg = jnp.asarray(_logits(rng))
    idx = jnp.asarray(_routing(rng))
    x = jnp.asarray(rng.standard_normal((T, H)).astype(F32))
    cases = [
        (lambda a: mj.topk_with_score(a, E + 1)[0], ValueError, "topk"),
        (lambda a: mj.topk_with_score(a, 2.5)[0], TypeError, "topk"),
        (lambda a: mj.topk_with_score(a, K, use_pre_softmax="False")[0], TypeError, "use_pre_softmax"),
        (lambda a: mj.topk_with_score(a, K, score_function="relu")[0], ValueError, "score_function"),
        (lambda a: mj.topk_with_score(a, K, num_groups=3, group_topk=1)[0], ValueError, "num_groups"),
        (lambda a: mj.topk_with_score(a, K, expert_bias=jnp.zeros(E))[0], ValueError, "expert_bias"),
        (lambda a: mj.topk_with_score(a.astype(jnp.int32), K)[0], TypeError, "logits"),
        (lambda a: mj.scores_for_aux_loss(a, K, "relu")[0], ValueError, "score_function"),
        (lambda a: mj.aux_loss(a, jnp.ones(E), T, 3, K, 0.1), ValueError, "num_experts"),
        (lambda a: mj.aux_loss(a, jnp.ones(E - 1), T, E, K, 0.1), ValueError, "tokens_per_expert"),
        (lambda a: mj.make_plan(idx, E, num_out_tokens=T * K + 1).dst_row, ValueError, "num_out_tokens"),
        (lambda a: mj.make_plan(idx, E, align_size=0).dst_row, ValueError, "align_size"),
        (lambda a: mj.make_plan(idx.astype(jnp.float32), E).dst_row, TypeError, "routing"),
        (lambda a: mj.dispatch(x[:-1], mj.make_plan(idx, E))[0], ValueError, "x"),
        (lambda a: mj.dispatch(x, mj.make_plan(idx, E), a[:, :3])[0], ValueError, "probs"),
        (lambda a: mj.combine(x, mj.make_plan(idx, E)), ValueError, "plan.num_rows"),
    ]
    for f, err, name in cases:
        with pytest.raises(err, match=name):
            jax.jit(f).lower(lg)
        with pytest.raises(err, match=name):
            jax.jit(f)(lg)
    ok = jax.jit(lambda a: mj.topk_with_score(a, K)[0])(lg)
    np.testing.assert_array_equal(np.asarray(ok), moe_rt.topk_with_score(np.asarray(lg), K)[0])


# ---- 5. small errors -----------------------------------------------------------------------------------

def test_row_count_errors_name_num_rows(rng):
    plan = moe_rt.make_plan(_routing(rng), E)
    bad = np.zeros((plan.num_rows - 1, H), F32)
    with pytest.raises(ValueError, match=r"y_permuted: expected \d+ rows \(plan.num_rows\)"):
        moe_rt.combine(bad, plan)
    with pytest.raises(ValueError, match=r"grad_x_permuted: expected \d+ rows \(plan.num_rows\)"):
        moe_rt.dispatch_backward(bad, plan)
    with pytest.raises(ValueError, match=r"x: expected \d+ rows \(plan.num_tokens\)"):
        moe_rt.dispatch(np.zeros((T + 1, H), F32), plan)


def test_make_plan_limits(rng, monkeypatch):
    idx = _routing(rng)
    moe_rt.make_plan(idx, E, num_out_tokens=T * K)
    with pytest.raises(ValueError, match="num_out_tokens"):
        moe_rt.make_plan(idx, E, num_out_tokens=T * K + 1)
    with pytest.raises(ValueError, match="num_out_tokens"):
        moe_rt.make_plan(np.ones((T, E), bool), E, num_out_tokens=T * E + 1)
    # a routing too large for the host: refused before the reference allocates anything
    monkeypatch.setattr(P, "_host_memory", lambda: 16 << 30)
    monkeypatch.setattr(P._ref, "make_plan", lambda *a, **k: pytest.fail("the reference ran"))
    big = np.broadcast_to(np.zeros((1, 1), np.int32), (2**31 - 1, 1))
    with pytest.raises(ValueError, match="GiB"):
        moe_rt.make_plan(big, 4)
    with pytest.raises(ValueError, match="2\\^31"):
        moe_rt.make_plan(np.broadcast_to(np.zeros((1, 1), np.int32), (2**30, 2)), 4)


def test_plan_is_made_by_make_plan(rng):
    with pytest.raises(TypeError, match="make_plan"):
        moe_rt.Plan()
    p = moe_rt.make_plan(_routing(rng), E)
    q = moe_rt.Plan.from_arrays(p.dst_row, p.src_slot, p.seg_start, p.counts, p.tokens_per_expert,
                                num_rows=p.num_rows)
    x = rng.standard_normal((T, H)).astype(F32)
    np.testing.assert_array_equal(moe_rt.dispatch(x, q)[0], moe_rt.dispatch(x, p)[0])


def test_grad_aux_loss_takes_numpy_scalars(rng):
    tpe = np.full(E, 3, np.int32)
    want = moe_rt.aux_loss_backward(np.array(2.0, F32), T, tpe, T, E, K, 0.1)
    for g in (np.float32(2.0), np.array([2.0], F32)):
        np.testing.assert_array_equal(moe_rt.aux_loss_backward(g, T, tpe, T, E, K, 0.1), want)
    with pytest.raises(TypeError, match="grad_aux_loss"):
        moe_rt.aux_loss_backward(2.0, T, tpe, T, E, K, 0.1)
    with pytest.raises(TypeError, match="grad_aux_loss: dtype"):
        moe_rt.aux_loss_backward(np.int32(2), T, tpe, T, E, K, 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_stream_of_a_wrong_type_is_refused(device, rng):
    lg = _t(_logits(rng), device)
    idx = _t(_routing(rng), device)
    plan = moe_rt.make_plan(idx, E)
    x = _t(rng.standard_normal((T, H)).astype(F32), device)
    calls = [lambda s: moe_rt.topk_with_score(lg, K, stream=s), lambda s: moe_rt.make_plan(idx, E, stream=s),
             lambda s: moe_rt.dispatch(x, plan, stream=s),
             lambda s: moe_rt.sort_chunks(x, np.array([T], np.int32), np.array([0], np.int32), stream=s)]
    for call in calls:
        for bad in ("0", 1.5, True, object()):
            with pytest.raises(TypeError, match="stream"):
                call(bad)
        with pytest.raises(ValueError, match="stream"):
            call(-1)
        call(None)
    g = moe_rt.EpGroup(None, E, H, 16)
    with pytest.raises(TypeError, match="stream"):
        g.prepare(idx, stream="0")
