"""CPU checks of benchmark helpers that carry math of their own (tools/)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))


def _against_ragged_dot(make_gmm, sizes, extra_rows, seed):
    """A grouped matmul of bench_layer against jax.lax.ragged_dot and XLA's gradient of it (fp32): the value,
    and the gradients of lhs and rhs; rows past the last group get zero output and zero gradient."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import bench_layer

    rng = np.random.default_rng(seed)
    G, H, F = len(sizes), 6, 5
    N = sum(sizes) + extra_rows
    lhs = jnp.asarray(rng.standard_normal((N, H)).astype(np.float32))
    rhs = jnp.asarray(rng.standard_normal((G, H, F)).astype(np.float32))
    gs = jnp.asarray(np.array(sizes, np.int32))
    cot = jnp.asarray(rng.standard_normal((N, F)).astype(np.float32))
    gmm = make_gmm(bench_layer)

    def loss(f):
        return lambda a, b: (f(a, b, gs) * cot).sum()

    want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
    got = jax.jit(jax.grad(loss(gmm), argnums=(0, 1)))(lhs, rhs)
    out = np.asarray(jax.jit(gmm)(lhs, rhs, gs))
    np.testing.assert_allclose(out, np.asarray(jax.lax.ragged_dot(lhs, rhs, gs)), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[sum(sizes):], 0)
    np.testing.assert_array_equal(np.asarray(got[0])[sum(sizes):], 0)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [[5, 0, 17, 3], [0, 0, 0, 9], [16, 16, 16, 16], [1, 40, 0, 2]])
@pytest.mark.parametrize("extra_rows", [0, 7])
def test_jax_grouped_matmul_matches_ragged_dot_gradient(sizes, extra_rows):
    """The blocked weight gradient (jax_grouped_matmul, blocks of 8 rows): groups that are empty, shorter
    than a block, exactly a block and several blocks, and rows past the last group."""
    _against_ragged_dot(lambda bl: bl.jax_grouped_matmul(block=8), sizes, extra_rows, 0)


@pytest.mark.parametrize("sizes,capacity", [([5, 0, 17, 3], 17), ([0, 0, 0, 9], 16), ([16, 16, 16, 16], 16),
                                            ([1, 40, 0, 2], 48)])
@pytest.mark.parametrize("extra_rows", [0, 7])
def test_jax_capacity_matmul_matches_ragged_dot(sizes, capacity, extra_rows):
    """The capacity grouped matmul (dense einsums over [G, C, *]): empty groups, groups equal to the
    capacity and shorter, and rows past the last group."""
    _against_ragged_dot(lambda bl: bl.jax_capacity_matmul(capacity), sizes, extra_rows, 1)


def test_profile_router_cases():
    """tools/profile_router.py names one case per (op, score function, dtype, E) and refuses others."""
    import profile_router

    assert len(profile_router.CASES) == 16 and "bwd-softmax-f32-E2304" in profile_router.CASES
    sys_argv = sys.argv
    sys.argv = ["profile_router.py", "fwd-softmax-f64-E2304"]
    try:
        with pytest.raises(SystemExit, match="unknown case"):
            profile_router.main()
    finally:
        sys.argv = sys_argv


def test_interleaved_timing_takes_turns(monkeypatch):
    """bench_layer.interleaved_us: every function timed once per round in a rotated order (so that the host's
    drift hits all alike), each batch closed by its own sync; per-call times are the medians over rounds."""
    import bench_layer

    clock = [0.0]
    monkeypatch.setattr(bench_layer.time, "perf_counter", lambda: clock[0])
    order, syncs = [], []

    def fn(name, cost):
        def call():
            clock[0] += cost
            if not order or order[-1] != name:
                order.append(name)
        return call

    fns = [(k, fn(k, c), lambda k=k: syncs.append(k)) for k, c in (("a", 2e-6), ("b", 5e-6), ("c", 1e-6))]
    us = bench_layer.interleaved_us(fns, n=4, reps=3)
    assert us == pytest.approx({"a": 2.0, "b": 5.0, "c": 1.0})
    # warm-up: each in turn; then three rounds, rotated: abc, bca, cab
    assert order == list("abc") + list("abc") + list("bca") + list("cab")
    assert syncs == list("abc") + list("abc") + list("bca") + list("cab")


def test_bare_functions_match_the_adapters():
    """bench_layer's bare autograd.Functions (the in-graph floor of any Function wrapper of the moe_rt calls)
    compute what the torch adapters compute: the same values and gradients, on the reference path."""
    torch = pytest.importorskip("torch")
    import bench_layer
    import moe_rt.torch as mt

    bare_d, bare_c, bare_topk = bench_layer._bare_functions()
    g = torch.Generator().manual_seed(3)
    T, H, E, K = 13, 24, 8, 3
    logits = torch.randn(T, E, generator=g) + torch.arange(E) * (1e-3 / E)  # no ties
    x = torch.randn(T, H, generator=g)
    gy, gl = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    probs, rmap = mt.topk_with_score(logits, K)
    plan = mt.make_plan(rmap, E)
    core = mt._plan_of(plan)
    got = []
    for bare in (False, True):
        xg, pg, lg = (t.clone().requires_grad_() for t in (x, probs, logits))
        if bare:
            y, p = bare_c.apply(bare_d.apply(xg, core), pg, core), bare_topk.apply(lg, K)[0]
        else:
            y, p = mt.combine(mt.dispatch(xg, plan)[0], plan, pg), mt.topk_with_score(lg, K)[0]
        got.append((y.detach(), p.detach(), *torch.autograd.grad((y, p), (xg, pg, lg), (gy, gl))))
    for a, b in zip(*got):
        assert torch.equal(a, b)
