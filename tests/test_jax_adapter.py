"""moe_rt.jax: custom_vjp ops over buffer_callback, inside jax.jit, under jax.grad and jax.checkpoint,
checked against the same math written in plain JAX. CPU runs the NumPy reference behind the same
callbacks; GPU runs the kernels on XLA's stream."""
import contextlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
mj = pytest.importorskip("moe_rt.jax")

DEVICES = [pytest.param("cpu"), pytest.param("gpu", marks=pytest.mark.gpu)]


def _on(device):
    return jax.default_device(jax.devices(device)[0]) if device == "cpu" else contextlib.nullcontext()


def _case(rng, T=23, E=6, K=3, H=16, dtype=jnp.float32):
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    idx[::4, -1] = -1
    x = jnp.asarray(rng.standard_normal((T, H)), dtype)
    probs = jnp.asarray(rng.random((T, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    return jnp.asarray(idx), x, probs, w, E


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("align_size", [1, 8])
@pytest.mark.parametrize("remat", [False, True])
def test_jit_grad_matches_plain_jax(device, align_size, remat, rng):
    with _on(device):
        idx, x, probs, w, E = _case(rng)

        def ours(x, probs):
            plan = mj.make_plan(idx, E, align_size=align_size)
            xp, pp = mj.dispatch(x, plan, probs)
            y = mj.combine(xp * 2, plan, probs)
            return (y.astype(jnp.float32) * w).sum() + (pp ** 2).sum()

        def plain(x, probs):
            valid = (idx >= 0).astype(jnp.float32)
            y = (2 * x[:, None, :].astype(jnp.float32) * (probs * valid)[..., None]).sum(1)
            return (y * w).sum() + ((probs * valid) ** 2).sum()

        f = jax.checkpoint(ours) if remat else ours
        v1, g1 = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, probs)
        v2, g2 = jax.value_and_grad(plain, argnums=(0, 1))(x, probs)
        np.testing.assert_allclose(v1, v2, rtol=1e-5)
        for a, b in zip(g1, g2):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_plan_is_a_pytree_with_static_sizes(device, rng):
    with _on(device):
        idx, x, probs, w, E = _case(rng)
        plan = jax.jit(lambda r: mj.make_plan(r, E, align_size=4))(idx)
        leaves, treedef = jax.tree_util.tree_flatten(plan)
        assert len(leaves) == 5 and all(leaf.dtype == jnp.int32 for leaf in leaves)
        again = jax.tree_util.tree_unflatten(treedef, leaves)
        assert again.static == plan.static and again.num_rows % 4 == 0
        counts = np.bincount(np.asarray(idx)[np.asarray(idx) >= 0], minlength=E)
        np.testing.assert_array_equal(np.asarray(plan.counts), counts)
        np.testing.assert_array_equal(np.asarray(plan.tokens_per_expert), -(-counts // 4) * 4)


def test_bad_plan_and_routing():
    with pytest.raises(TypeError, match="plan: expected a JaxPlan"):
        mj.dispatch(jnp.zeros((2, 4)), object())
    with pytest.raises(ValueError, match="routing: expected a 2-D array"):
        mj.make_plan(jnp.zeros(3, jnp.int32), 4)
