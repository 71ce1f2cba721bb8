"""moe_rt.jax: custom_vjp ops inside jax.jit, under jax.grad and jax.checkpoint, checked against the same
math written in plain JAX. CPU runs the NumPy reference behind buffer_callback; GPU runs the kernels on
XLA's stream (XLA FFI custom calls: docs/design.md §4 lists the ops; callbacks for the rest;
tests/test_jax_ffi.py tests the FFI path itself)."""
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


# -- router ----------------------------------------------------------------------------------------------

def _plain_topk(l, K, sf, pre, scale):
    T = l.shape[0]
    rows = jnp.arange(T)[:, None]
    if sf == "softmax":
        if pre:
            a = jax.nn.softmax(l, -1)
            v, i = jax.lax.top_k(a, K)
            return jnp.zeros_like(a).at[rows, i].set(v) * scale
        v, i = jax.lax.top_k(l, K)
        return jnp.zeros_like(l).at[rows, i].set(jax.nn.softmax(v, -1)) * scale
    a = jax.nn.sigmoid(l) if sf == "sigmoid" else jnp.sqrt(jax.nn.softplus(l))
    v, i = jax.lax.top_k(a, K)
    v = v / (v.sum(-1, keepdims=True) + 1e-20)
    return jnp.zeros_like(a).at[rows, i].set(v) * scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sf,pre", [("softmax", False), ("softmax", True), ("sigmoid", False),
                                    ("sqrtsoftplus", False)])
def test_topk_with_score_jit_grad(device, sf, pre, rng):
    with _on(device):
        T, E, K = 21, 16, 4
        logits = jnp.asarray(rng.standard_normal((T, E)) + np.arange(E) * (1e-3 / E), jnp.float32)
        gp = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
        f = lambda l: (mj.topk_with_score(l, K, score_function=sf, use_pre_softmax=pre,  # noqa: E731
                                          scaling_factor=1.5)[0] * gp).sum()
        f2 = lambda l: (_plain_topk(l, K, sf, pre, 1.5) * gp).sum()  # noqa: E731
        v1, g1 = jax.jit(jax.value_and_grad(f))(logits)
        v2, g2 = jax.value_and_grad(f2)(logits)
        np.testing.assert_allclose(v1, v2, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_aux_loss_jit_grad(device, rng):
    with _on(device):
        T, E, K = 25, 8, 2
        logits = jnp.asarray(rng.standard_normal((T, E)) + np.arange(E) * 1e-4, jnp.float32)

        def ours(l):
            s, m = mj.scores_for_aux_loss(l, K, "softmax")
            return mj.aux_loss(s, m.sum(0).astype(jnp.int32), T, E, K, 0.01)

        def plain(l):
            s = jax.nn.softmax(l, -1)
            _, i = jax.lax.top_k(s, K)
            tpe = jax.lax.stop_gradient(jnp.zeros_like(s).at[jnp.arange(T)[:, None], i].set(1.0).sum(0))
            return (E * 0.01) / K / T / T * (s.sum(0) * tpe).sum()

        v1, g1 = jax.jit(jax.value_and_grad(ours))(logits)
        v2, g2 = jax.value_and_grad(plain)(logits)
        assert v1.shape == ()
        np.testing.assert_allclose(v1, v2, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-5, atol=1e-8)


def test_plan_shapes_checked_when_traced():
    import jax.numpy as jnp

    plan = mj.make_plan(jnp.asarray(np.array([[0, 1], [1, -1], [2, 0]], np.int32)), 3)
    x = jnp.ones((3, 4), jnp.float32)
    bad = mj.JaxPlan(plan.arrays[:1] + (plan.arrays[1][:-1],) + plan.arrays[2:], *plan.static)
    with pytest.raises(ValueError, match="plan: src_slot must have shape"):
        mj.dispatch(x, bad)
    with pytest.raises(ValueError, match="plan: a JaxPlan holds five int32 arrays"):
        mj.combine(x, mj.JaxPlan(tuple(a.astype(jnp.float32) for a in plan.arrays), *plan.static))
    with pytest.raises(TypeError, match="plan: expected a JaxPlan"):
        mj.dispatch(x, tuple(plan.arrays))


def test_callback_results_copied_on_xla_stream(monkeypatch):
    """_run's GPU path: a result that did not land in its XLA output (an unrelated temporary of the same byte
    size took that buffer from _into) is copied there with XLA's device and stream still current. Copied after
    leaving them, it went to CuPy's default (legacy) stream, which XLA's non-blocking stream does not wait
    for: on 4 H100 the weight gradient of a JAX EP program over the NCCL transport (combine's VJP, whose
    [rows,K] index temporary has the byte size of its [N] output) came out wrong in a run queued behind
    another. Driven on the CPU with stand-ins for XLA's stream, device and buffers."""
    events = []

    class Scope:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            events.append(f"enter {self.name}")
            return self

        def __exit__(self, *exc):
            events.append(f"exit {self.name}")
            return False

    class Ctx:  # what a buffer_callback gets on the GPU: XLA's stream
        stream = 0x1234

    got = {}

    def buffer_callback(cb, specs, **kw):
        got["callback"] = cb
        return lambda *args: [jnp.zeros(s.shape, s.dtype) for s in specs]

    def write(dsts, results, on_gpu):
        events.append("write")
        for d, r in zip(dsts, results):
            d[...] = r

    def fn(xv, wv):
        events.append("fn")
        return [xv[::-1] * 2, wv + 1]

    monkeypatch.setattr(mj, "buffer_callback", buffer_callback)
    monkeypatch.setattr(mj, "_gpu_stream", lambda sptr, buf: (Scope("stream"), Scope("device"), 0))
    monkeypatch.setattr(mj, "_view", lambda buf, dev_id: buf)
    monkeypatch.setattr(mj, "_into", lambda dsts: Scope("into"))
    monkeypatch.setattr(mj, "_write", write)
    rng = np.random.default_rng(11)
    x, w = rng.standard_normal(7).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    mj._run(fn, [mj._spec(x.shape, x.dtype), mj._spec(w.shape, w.dtype)], jnp.asarray(x), jnp.asarray(w),
            collective=True)
    outs = [np.full(x.shape, np.nan, np.float32), np.full(w.shape, np.nan, np.float32)]
    got["callback"](Ctx(), outs, x, w)
    assert events == ["enter device", "enter stream", "enter into", "fn", "exit into", "write", "exit stream",
                      "exit device"], events
    np.testing.assert_array_equal(outs[0], x[::-1] * 2)
    np.testing.assert_array_equal(outs[1], w + 1)


def test_callback_stream_failure_raises_on_gpu_buffers(monkeypatch):
    """_run's callback reads XLA's stream from its context; CPU buffers have none (the NumPy path runs), but on
    buffers of a GPU a failure to read it raises instead of running the op on CuPy's current stream, unordered
    with XLA's. Driven on the CPU with a context whose stream raises and buffers whose DLPack device is CUDA."""

    class StreamFails(RuntimeError):
        pass

    class Ctx:
        @property
        def stream(self):
            raise StreamFails("XLA FFI GPU context is not available")

    class Buf:  # an XLA buffer as the callback sees it, on DLPack device (type, id)
        def __init__(self, a, dev):
            self.a, self.dev, self.dtype, self.shape = a, dev, a.dtype, a.shape

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.dev

    got = {}

    def buffer_callback(cb, specs, **kw):
        got["callback"] = cb
        return lambda *args: [jnp.zeros(s.shape, s.dtype) for s in specs]

    ran = []

    def fn(xv):
        ran.append(type(xv))
        return [xv * 2]

    rng = np.random.default_rng(12)
    x = rng.standard_normal(7).astype(np.float32)
    monkeypatch.setattr(mj, "buffer_callback", buffer_callback)
    mj._run(fn, [mj._spec(x.shape, x.dtype)], jnp.asarray(x))
    out = np.full(x.shape, np.nan, np.float32)
    for dev_in, dev_out in (((2, 0), (2, 0)), ((1, 0), (2, 0)), ((2, 1), (1, 0)), ((13, 0), (13, 0))):
        # buffers on a GPU (kDLCUDA = 2, kDLCUDAManaged = 13; one is enough): the stream's failure, nothing run
        with pytest.raises(StreamFails, match="GPU context is not available"):
            got["callback"](Ctx(), [Buf(out, dev_out)], Buf(x, dev_in))
    assert not ran and np.isnan(out).all()
    got["callback"](Ctx(), [Buf(out, (1, 0))], Buf(x, (1, 0)))  # CPU buffers: the NumPy path
    assert ran == [np.ndarray]
    np.testing.assert_array_equal(out, x * 2)
    monkeypatch.undo()
    # the real callback on the CPU (whose context has no stream either): the NumPy path
    y = mj._run(lambda v: [v[::-1] + 1], [mj._spec(x.shape, x.dtype)], jax.device_put(x, jax.devices("cpu")[0]))
    np.testing.assert_array_equal(np.asarray(y[0]), x[::-1] + 1)
