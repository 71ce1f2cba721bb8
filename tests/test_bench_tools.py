"""CPU checks of benchmark helpers that carry math of their own (tools/)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))


@pytest.mark.parametrize("sizes", [[5, 0, 17, 3], [0, 0, 0, 9], [16, 16, 16, 16], [1, 40, 0, 2]])
@pytest.mark.parametrize("extra_rows", [0, 7])
def test_jax_grouped_matmul_matches_ragged_dot_gradient(sizes, extra_rows):
    """bench_layer's blocked weight gradient against XLA's gradient of ragged_dot (small sizes, fp32), with
    groups that are empty, shorter than a block, exactly a block and several blocks, and rows past the
    last group (which ragged_dot leaves out)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import bench_layer

    rng = np.random.default_rng(0)
    G, H, F = len(sizes), 6, 5
    N = sum(sizes) + extra_rows
    lhs = jnp.asarray(rng.standard_normal((N, H)).astype(np.float32))
    rhs = jnp.asarray(rng.standard_normal((G, H, F)).astype(np.float32))
    gs = jnp.asarray(np.array(sizes, np.int32))
    cot = jnp.asarray(rng.standard_normal((N, F)).astype(np.float32))
    gmm = bench_layer.jax_grouped_matmul(block=8)

    def loss(f):
        return lambda a, b: (f(a, b, gs) * cot).sum()

    want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
    got = jax.jit(jax.grad(loss(gmm), argnums=(0, 1)))(lhs, rhs)
    np.testing.assert_allclose(np.asarray(gmm(lhs, rhs, gs)), np.asarray(jax.lax.ragged_dot(lhs, rhs, gs)),
                               rtol=1e-6, atol=1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
