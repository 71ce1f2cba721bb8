"""Expert-parallel adapters: moe_rt.torch.ep_* (autograd custom ops) and moe_rt.jax.ep_* (custom_vjp over
buffer_callback, inside jit). One-rank groups (no NCCL) on CPU (the reference behind the same ops) and on
one GPU, checked against the same math in plain framework code; the EP layer over 2 GPUs through the demo
(`python -m moe_rt demo --ep 2`, also `--ep-mode low_latency`), which checks itself against the single-GPU
plain layer."""
import os
import subprocess
import sys

import numpy as np
import pytest

import moe_rt

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy
mt = pytest.importorskip("moe_rt.torch")
mj = pytest.importorskip("moe_rt.jax")

E, H, K = 8, 24, 3


def _routing(rng, T):
    idx = np.array([rng.permutation(E)[:K] for _ in range(T)], np.int32).reshape(T, K)
    idx[::4, -1] = -1  # some slots route nowhere
    return idx


def _plain(x, w, idx, scale):
    """dispatch -> scale * rows -> weighted combine, as plain math: out[t] = scale * x[t] * sum_k w[t,k]."""
    valid = (idx >= 0).astype(np.float64)
    return scale * x.astype(np.float64) * (w.astype(np.float64) * valid).sum(1, keepdims=True)


TORCH_DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("T", [0, 1, 19])
def test_torch_ep_autograd_matches_plain(device, mode, T, rng):
    idx = _routing(rng, T)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    g = rng.standard_normal((T, H)).astype(np.float32)
    group = moe_rt.EpGroup(None, E, H, 32, mode=mode)
    xt = torch.tensor(x, device=device, requires_grad=True)
    wt = torch.tensor(w, device=device, requires_grad=True)
    h = mt.ep_prepare(group, torch.tensor(idx, device=device))
    assert isinstance(h, mt.TorchEpHandle) and h.buffer.dtype == torch.uint8
    rx, rw = mt.ep_dispatch(h, xt, wt)
    assert rx.shape == (h.num_rows, H) and rw.shape == (h.num_rows,)
    assert int(h.tokens_per_expert.sum()) == int((idx >= 0).sum())
    out = mt.ep_combine(h, rx * 1.5, rw)
    out.backward(torch.tensor(g, device=device))
    np.testing.assert_allclose(out.detach().cpu().numpy(), _plain(x, w, idx, 1.5), rtol=1e-5, atol=1e-5)
    valid = (idx >= 0)
    np.testing.assert_allclose(xt.grad.cpu().numpy(), 1.5 * g * (w * valid).sum(1, keepdims=True),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(wt.grad.cpu().numpy(), 1.5 * (x * g).sum(1, keepdims=True) * valid,
                               rtol=1e-4, atol=1e-5)
    # unweighted combine: the transpose of dispatch (K-fold copy where every slot is kept)
    u = mt.ep_combine(h, rx)
    np.testing.assert_allclose(u.detach().cpu().numpy(), _plain(x, np.ones_like(w), idx, 1.0), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("device", TORCH_DEVICES)
def test_torch_ep_compiles_without_graph_breaks(device, rng):
    """fullgraph=True fails on any graph break; CPU uses the aot_eager backend (dynamo + fake kernels + the
    autograd graph, no C++ compiler needed), CUDA the default inductor."""
    group = moe_rt.EpGroup(None, E, H, 32, mode="capacity")
    idx = torch.tensor(_routing(rng, 17), device=device)
    x = torch.randn(17, H, device=device, requires_grad=True)
    w = torch.rand(17, K, device=device, requires_grad=True)

    def layer(x, w, idx):
        h = mt.ep_prepare(group, idx)
        rx, rw = mt.ep_dispatch(h, x, w)
        return mt.ep_combine(h, torch.nn.functional.silu(rx), rw)

    eager = layer(x, w, idx)
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(layer, fullgraph=True, backend=backend)(x, w, idx)
    torch.testing.assert_close(compiled, eager)
    gc = torch.autograd.grad(compiled.square().sum(), [x, w])
    ge = torch.autograd.grad(layer(x, w, idx).square().sum(), [x, w])
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_torch_ep_bad_input(rng):
    group = moe_rt.EpGroup(None, E, H, 8)
    idx = torch.tensor(_routing(rng, 5))
    with pytest.raises(TypeError, match="EpGroup"):
        mt.ep_prepare(object(), idx)
    with pytest.raises(ValueError, match="topk_idx"):
        mt.ep_prepare(group, idx[0])
    h = mt.ep_prepare(group, idx)
    with pytest.raises(TypeError, match="TorchEpHandle"):
        mt.ep_dispatch(tuple(h), torch.randn(5, H))
    with pytest.raises(ValueError, match="shape"):
        mt.ep_dispatch(h, torch.randn(5, H + 1))
    rx, _ = mt.ep_dispatch(h, torch.randn(5, H))
    with pytest.raises(ValueError, match="recv_weights"):
        mt.ep_combine(h, rx, torch.ones(h.num_rows + 1))
    group.close()
    with pytest.raises(ValueError, match="closed"):
        mt.ep_dispatch(h, torch.randn(5, H))


def _fp8_reference(x, idx, w, mode):
    """quantize_fp8 then the 1-rank reference dispatch of the codes and of the scales: (codes uint8 [N,H],
    scales [N,S], recv_weights [N], the rows dequantized to x's dtype)."""
    from moe_rt.reference import ep as ref
    from moe_rt.reference import fp8 as fref

    kw = {} if mode == "exact" else {"pair_capacity": 32, "capacity": 32 * min(K, E)}
    hs = ref.prepare([idx], E, **kw)
    q, s = fref.quantize_fp8(x)
    rq, rw, _ = ref.dispatch(hs, [q], [w])[0]
    rs = ref.dispatch(hs, [s])[0][0]
    return rq.view(np.uint8), rs, rw, fref.dequantize_fp8(rq, rs, x.dtype), (q, s)


def _torch_bf16(a, device):
    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16).to(device)


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("mode", ["exact", "capacity"])
def test_torch_ep_fp8_dispatch(device, mode, rng):
    # fp8=True: float8_e4m3fn rows + fp32 scales bitwise equal to quantize-then-dispatch; no gradient through
    # them, recv_weights' gradient as after a plain dispatch; dequantize=True: straight-through gradient,
    # equal to the plain dispatch's; pairs (float8 or uint8) give the same bits
    import ml_dtypes

    T = 19
    Hf = 200  # two scale blocks, the last one of 72 channels
    idx = _routing(rng, T)
    x = rng.standard_normal((T, Hf)).astype(np.float32).astype(ml_dtypes.bfloat16)
    w = rng.random((T, K)).astype(np.float32)
    rq, rs, rw, rdq, (q, s) = _fp8_reference(x, idx, w, mode)
    group = moe_rt.EpGroup(None, E, Hf, 32, mode=mode)
    h = mt.ep_prepare(group, torch.tensor(idx, device=device))
    xt = _torch_bf16(x, device).requires_grad_(True)
    wt = torch.tensor(w, device=device, requires_grad=True)
    tq, ts, tw = mt.ep_dispatch(h, xt, wt, fp8=True)
    assert tq.dtype == torch.float8_e4m3fn and ts.dtype == torch.float32
    assert not tq.requires_grad and not ts.requires_grad and tw.requires_grad
    assert np.array_equal(tq.view(torch.uint8).cpu().numpy(), rq) and np.array_equal(ts.cpu().numpy(), rs)
    assert np.array_equal(tw.detach().cpu().numpy(), rw)
    gw_out = torch.randn(h.num_rows, device=device)
    (gw_fp8,) = torch.autograd.grad((tw * gw_out).sum(), [wt])
    _, pw = mt.ep_dispatch(h, xt, wt)
    (gw_plain,) = torch.autograd.grad((pw * gw_out).sum(), [wt])
    assert torch.equal(gw_fp8, gw_plain)
    # dequantize=True: rows dequantized on the receiving side, straight-through gradient to x
    y, yw = mt.ep_dispatch(h, xt, wt, fp8=True, dequantize=True)
    assert y.dtype == torch.bfloat16 and np.array_equal(y.detach().view(torch.int16).cpu().numpy(),
                                                       rdq.view(np.int16))
    gy = torch.randn(h.num_rows, Hf, device=device).to(torch.bfloat16)
    gx_fp8, gw_deq = torch.autograd.grad((y.float() * gy.float()).sum() + (yw * gw_out).sum(), [xt, wt])
    px, pw = mt.ep_dispatch(h, xt, wt)
    gx_plain, _ = torch.autograd.grad((px.float() * gy.float()).sum() + (pw * gw_out).sum(), [xt, wt])
    assert torch.equal(gx_fp8, gx_plain) and torch.equal(gw_deq, gw_plain)
    # pre-quantized pairs
    tq8 = torch.from_numpy(q.view(np.uint8)).to(device)
    for pair in ((tq8.view(torch.float8_e4m3fn), torch.from_numpy(s).to(device)),
                 (tq8, torch.from_numpy(s).to(device))):
        pq, ps, pw2 = mt.ep_dispatch(h, pair, fp8=True)
        assert pq.dtype == pair[0].dtype and pw2 is None
        assert np.array_equal(pq.view(torch.uint8).cpu().numpy(), rq) and np.array_equal(ps.cpu().numpy(), rs)
        pd, _ = mt.ep_dispatch(h, pair, fp8=True, dequantize=True)
        assert pd.dtype == torch.bfloat16 and torch.equal(pd, y.detach())
    # bad input
    with pytest.raises(TypeError, match="fp8=True"):
        mt.ep_dispatch(h, pair)
    with pytest.raises(ValueError, match="dequantize"):
        mt.ep_dispatch(h, xt, dequantize=True)
    with pytest.raises(ValueError, match="scales: expected shape"):
        mt.ep_dispatch(h, (tq8, torch.ones(T, 3, device=device)), fp8=True)
    with pytest.raises(TypeError, match="x_fp8"):
        mt.ep_dispatch(h, (tq8.to(torch.float16), torch.from_numpy(s).to(device)), fp8=True)
    with pytest.raises(TypeError, match="scales"):
        mt.ep_dispatch(h, (tq8, np.asarray(s)), fp8=True)
    if mode == "capacity":
        f = torch.compile(lambda x, w: mt.ep_dispatch(h, x, w, fp8=True), fullgraph=True,
                          backend="inductor" if device == "cuda" else "aot_eager")
        cq, cs, _ = f(xt.detach(), wt.detach())
        assert torch.equal(cq.view(torch.uint8), tq.view(torch.uint8)) and torch.equal(cs, ts)


JAX_DEVICES = [pytest.param("cpu"), pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", JAX_DEVICES)
def test_jax_ep_fp8_dispatch(device, rng):
    # as test_torch_ep_fp8_dispatch, under jit: jnp.float8_e4m3fn rows + scales; recv_weights' gradient;
    # dequantize=True with the straight-through VJP; pairs; trace-time checks
    import ml_dtypes

    T, Hf = 19, 200
    idx = _routing(rng, T)
    x = rng.standard_normal((T, Hf)).astype(np.float32).astype(ml_dtypes.bfloat16)
    w = rng.random((T, K)).astype(np.float32)
    rq, rs, rw, rdq, (q, s) = _fp8_reference(x, idx, w, "capacity")
    group = moe_rt.EpGroup(None, E, Hf, 32, mode="capacity")
    with jax.default_device(jax.devices(device)[0]):
        h = mj.ep_prepare(group, jnp.asarray(idx))
        jx, jw = jnp.asarray(x), jnp.asarray(w)
        jq, js, jrw = jax.jit(lambda h, x, w: mj.ep_dispatch(h, x, w, fp8=True))(h, jx, jw)
        assert jq.dtype == jnp.float8_e4m3fn and js.dtype == jnp.float32
        assert np.array_equal(np.asarray(jq).view(np.uint8), rq) and np.array_equal(np.asarray(js), rs)
        assert np.array_equal(np.asarray(jrw), rw)
        gw_out = jnp.asarray(rng.standard_normal(h.num_rows).astype(np.float32))
        gy = jnp.asarray(rng.standard_normal((h.num_rows, Hf)).astype(np.float32))

        def loss(x, w, fp8):
            if fp8 == "rows":
                return (mj.ep_dispatch(h, x, w, fp8=True)[2] * gw_out).sum()
            rx, rw_ = mj.ep_dispatch(h, x, w, fp8=fp8, dequantize=fp8)
            return (rx.astype(jnp.float32) * gy).sum() + (rw_ * gw_out).sum()

        g_rows = jax.jit(jax.grad(lambda w: loss(jx, w, "rows")))(jw)
        gx_deq, gw_deq = jax.jit(jax.grad(lambda x, w: loss(x, w, True), argnums=(0, 1)))(jx, jw)
        gx_plain, gw_plain = jax.grad(lambda x, w: loss(x, w, False), argnums=(0, 1))(jx, jw)
        assert np.array_equal(np.asarray(g_rows), np.asarray(gw_plain))
        assert np.array_equal(np.asarray(gx_deq), np.asarray(gx_plain))
        assert np.array_equal(np.asarray(gw_deq), np.asarray(gw_plain))
        y, _ = mj.ep_dispatch(h, jx, jw, fp8=True, dequantize=True)
        assert y.dtype == jnp.bfloat16 and np.array_equal(np.asarray(y).view(np.int16), rdq.view(np.int16))
        for pair in ((jnp.asarray(q), jnp.asarray(s)), (jnp.asarray(q.view(np.uint8)), jnp.asarray(s))):
            pq, ps, pw = jax.jit(lambda h, a, b: mj.ep_dispatch(h, (a, b), fp8=True))(h, *pair)
            assert pq.dtype == pair[0].dtype and pw is None
            assert np.array_equal(np.asarray(pq).view(np.uint8), rq) and np.array_equal(np.asarray(ps), rs)
            pd, _ = mj.ep_dispatch(h, pair, fp8=True, dequantize=True)
            assert np.array_equal(np.asarray(pd).view(np.int16), rdq.view(np.int16))
        with pytest.raises(TypeError, match="fp8=True"):
            mj.ep_dispatch(h, pair)
        with pytest.raises(ValueError, match="scales: expected shape"):
            mj.ep_dispatch(h, (pair[0], jnp.ones((T, 3), jnp.float32)), fp8=True)
        with pytest.raises(TypeError, match="scales: dtype"):
            mj.ep_dispatch(h, (pair[0], jnp.ones((T, 2), jnp.bfloat16)), fp8=True)
        with pytest.raises(TypeError, match="x_fp8"):
            mj.ep_dispatch(h, (jnp.zeros((T, Hf), jnp.float8_e5m2), pair[1]), fp8=True)
        with pytest.raises(ValueError, match="x_fp8: expected shape"):
            mj.ep_dispatch(h, (pair[0][:, :-1], pair[1]), fp8=True)


@pytest.mark.parametrize("device", JAX_DEVICES)
@pytest.mark.parametrize("T", [0, 19])
@pytest.mark.parametrize("remat", [False, True])
def test_jax_ep_jit_grad_matches_plain(device, T, remat, rng):
    idx = _routing(rng, T)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    g = rng.standard_normal((T, H)).astype(np.float32)
    group = moe_rt.EpGroup(None, E, H, 32, mode="capacity")
    with jax.default_device(jax.devices(device)[0]):
        def loss(x, w):
            h = mj.ep_prepare(group, jnp.asarray(idx))
            rx, rw = mj.ep_dispatch(h, x, w)
            out = mj.ep_combine(h, rx * 1.5, rw)
            return (out * g).sum(), out

        f = jax.checkpoint(loss) if remat else loss
        (_, out), (gx, gw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(jnp.asarray(x),
                                                                                          jnp.asarray(w))
    valid = idx >= 0
    np.testing.assert_allclose(np.asarray(out), _plain(x, w, idx, 1.5), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), 1.5 * g * (w * valid).sum(1, keepdims=True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), 1.5 * (x * g).sum(1, keepdims=True) * valid, rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("device", JAX_DEVICES)
def test_jax_ep_grad_behind_a_busy_stream(device, rng):
    """The weight gradient of combine's VJP over a group of the buffer_callback path while XLA's stream is
    still busy when the callbacks run (a chain of matmuls the loss's cotangent waits for), two runs back to
    back. With L >= K combine's VJP has a [rows,K] index temporary of its [N] output's byte size, which takes
    that buffer, so its result is copied in: that copy must run on XLA's stream (on CuPy's default stream it
    read the result before the kernels wrote it: on 4 H100 the NCCL group's weight gradient was wrong in a
    run queued behind another)."""
    T, (n, steps) = 19, ((4096, 100) if device == "gpu" else (48, 4))
    idx = _routing(rng, T)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    g = rng.standard_normal((T, H)).astype(np.float32)
    big = (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    group = moe_rt.EpGroup(None, E, H, 32, mode="capacity")
    assert group.num_local_experts >= K
    with jax.default_device(jax.devices(device)[0]):
        def loss(x, w, big):
            m = big
            for _ in range(steps):
                m = jnp.tanh(m @ big)
            c = 1.0 + 1e-3 * m.mean()  # the cotangent of out waits for the chain
            h = mj.ep_prepare(group, jnp.asarray(idx))
            rx, rw = mj.ep_dispatch(h, x, w)
            out = mj.ep_combine(h, rx * 1.5, rw)
            return (out * g).sum() * c, (out, c)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(big))
        first = step(*args)
        again = step(*args)  # queued while the first may still run
    valid = idx >= 0
    for (_, (out, c)), (gx, gw) in (first, again):
        c = float(np.asarray(c))
        np.testing.assert_allclose(np.asarray(out), _plain(x, w, idx, 1.5), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(gx), c * 1.5 * g * (w * valid).sum(1, keepdims=True), rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(np.asarray(gw), c * 1.5 * (x * g).sum(1, keepdims=True) * valid, rtol=1e-4,
                                   atol=1e-5)

def _record_zero_flag(monkeypatch):
    """EpGroup.dispatch wrapped to record the zero_empty_slots it is called with (None: not passed)."""
    seen, orig = [], moe_rt.EpGroup.dispatch

    def dispatch(self, *a, **k):
        seen.append(k.get("zero_empty_slots"))
        return orig(self, *a, **k)

    monkeypatch.setattr(moe_rt.EpGroup, "dispatch", dispatch)
    return seen


def test_torch_ep_dispatch_zero_empty_slots(monkeypatch, rng):
    """moe_rt.torch.ep_dispatch passes zero_empty_slots to EpGroup.dispatch (True unless the caller passes
    False; plain, FP8 and dequantized), refuses a non-bool with a TypeError naming it; on the CPU (the reference
    writes zero rows either way) the rows and gradients are the same."""
    seen = _record_zero_flag(monkeypatch)
    T = 19
    idx, x = _routing(rng, T), rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    group = moe_rt.EpGroup(None, E, H, 32, mode="capacity")
    h = mt.ep_prepare(group, torch.tensor(idx))
    res = {}
    for zero in (None, True, False):
        xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
        kw = {} if zero is None else {"zero_empty_slots": zero}
        rx, rw = mt.ep_dispatch(h, xt, wt, **kw)
        mt.ep_combine(h, rx * 1.5, rw).square().sum().backward()
        res[zero] = [a.detach().numpy() for a in (rx, rw, xt.grad, wt.grad)]
        mt.ep_dispatch(h, xt, wt, fp8=True, **kw)
        mt.ep_dispatch(h, xt, wt, fp8=True, dequantize=True, **kw)
    assert seen == [True] * 6 + [False] * 3
    for a, b in zip(res[None], res[False]):
        assert np.array_equal(a, b)
    for bad in (1, None, "False"):
        with pytest.raises(TypeError, match="zero_empty_slots: expected a bool"):
            mt.ep_dispatch(h, torch.tensor(x), zero_empty_slots=bad)


def test_jax_ep_dispatch_zero_empty_slots(monkeypatch, rng):
    """moe_rt.jax.ep_dispatch under jit: zero_empty_slots (a static flag) reaches EpGroup.dispatch, True unless
    the caller passes False (plain, FP8, dequantized, and the VJP's forward); a non-bool is a TypeError naming
    it; on the CPU the rows and gradients are the same either way."""
    seen = _record_zero_flag(monkeypatch)
    T = 19
    idx, x = _routing(rng, T), rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    group = moe_rt.EpGroup(None, E, H, 32, mode="capacity")
    with jax.default_device(jax.devices("cpu")[0]):
        h = mj.ep_prepare(group, jnp.asarray(idx))
        jx, jw = jnp.asarray(x), jnp.asarray(w)

        def loss(x, w, kw):
            rx, rw = mj.ep_dispatch(h, x, w, **kw)
            return (mj.ep_combine(h, rx * 1.5, rw) ** 2).sum()

        res = {}
        for zero in (None, False):
            kw = {} if zero is None else {"zero_empty_slots": zero}
            n = len(seen)
            rx, rw = jax.jit(lambda x, w: mj.ep_dispatch(h, x, w, **kw))(jx, jw)
            grads = jax.jit(jax.grad(lambda x, w: loss(x, w, kw), argnums=(0, 1)))(jx, jw)
            jax.jit(lambda x, w: mj.ep_dispatch(h, x, w, fp8=True, **kw))(jx, jw)
            jax.jit(lambda x, w: mj.ep_dispatch(h, x, w, fp8=True, dequantize=True, **kw))(jx, jw)
            assert seen[n:] == [zero is None] * 4, seen[n:]
            res[zero] = [np.asarray(a) for a in (rx, rw, *grads)]
        for a, b in zip(res[None], res[False]):
            assert np.array_equal(a, b)
        with pytest.raises(TypeError, match="zero_empty_slots: expected a bool"):
            mj.ep_dispatch(h, jx, jw, zero_empty_slots=0)


def test_jax_ep_handle_pytree_and_errors(rng):
    idx = jnp.asarray(_routing(rng, 6))
    group = moe_rt.EpGroup(None, E, H, 8, mode="capacity")
    with jax.default_device(jax.devices("cpu")[0]):
        h = jax.jit(lambda i: mj.ep_prepare(group, i))(idx)
        leaves, tree = jax.tree_util.tree_flatten(h)
        assert [np.dtype(a.dtype) for a in leaves] == [np.uint8, np.int32]
        assert jax.tree_util.tree_unflatten(tree, leaves).num_rows == h.num_rows
        with pytest.raises(ValueError, match="capacity"):
            mj.ep_prepare(moe_rt.EpGroup(None, E, H, 8, mode="exact"), idx)
        with pytest.raises(TypeError, match="JaxEpHandle"):
            mj.ep_dispatch(None, jnp.zeros((6, H)))
        with pytest.raises(ValueError, match="rows"):
            mj.ep_dispatch(h, jnp.zeros((5, H)))
        with pytest.raises(ValueError, match="rows"):
            mj.ep_combine(h, jnp.zeros((h.num_rows + 1, H)))


def test_jax_vmap_runs_each_element(rng):
    """vmap of the adapters is a loop over the batch: it must equal the ops applied one element at a time."""
    with jax.default_device(jax.devices("cpu")[0]):
        logits = jnp.asarray(rng.standard_normal((3, 7, E)).astype(np.float32))
        batched = jax.vmap(lambda l: mj.topk_with_score(l, 2)[0])(logits)
        one = jnp.stack([mj.topk_with_score(logits[i], 2)[0] for i in range(3)])
        np.testing.assert_array_equal(np.asarray(batched), np.asarray(one))
        idx = jnp.asarray(np.stack([_routing(rng, 7) for _ in range(3)]))
        x = jnp.asarray(rng.standard_normal((3, 7, H)).astype(np.float32))

        def layer(i, t):
            plan = mj.make_plan(i, E)
            return mj.combine(mj.dispatch(t, plan)[0] * 2, plan)

        out = jax.jit(jax.vmap(layer))(idx, x)
        valid = (np.asarray(idx) >= 0).sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(out), 2 * np.asarray(x) * valid, rtol=1e-6)
        gx = jax.grad(lambda t: jax.vmap(layer)(idx, t).sum())(x)
        np.testing.assert_allclose(np.asarray(gx), 2 * np.broadcast_to(valid, x.shape), rtol=1e-6)


# -- 2 GPUs: the EP layer of the demo, checked against the plain single-GPU layer -------------------------------

_EP_LAYERS = [(f, m) for f in ("torch", "jax") for m in ("normal", "low_latency", "normal-fp8", "low_latency-fp8")]


@pytest.mark.multi_gpu
@pytest.mark.parametrize("framework,ep_mode", _EP_LAYERS)
def test_ep_layer_two_gpus_matches_single_gpu(framework, ep_mode):
    mode, _, fp8 = ep_mode.partition("-")
    cmd = [sys.executable, "-m", "moe_rt", "demo", "--framework", framework, "--ep", "2", "--tokens", "512",
           "--experts", "16", "--topk", "4", "--hidden", "256", "--ffn", "128", "--steps", "3", "--ep-mode", mode]
    cmd += ["--fp8"] if fp8 else []
    env = dict(os.environ, MOE_RT_EP_TIMEOUT="60")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    print(r.stdout[-8000:])
    print(r.stderr[-4000:])
    assert r.returncode == 0
    for rank in (0, 1):
        assert f"[rank {rank}]   grad w_router" in r.stdout
    assert "FAIL" not in r.stdout


@pytest.mark.parametrize("framework,ep_mode", _EP_LAYERS)
def test_ep_layer_worker_cpu_dry_run(framework, ep_mode):
    """The EP layer code of `demo --ep [--ep-mode low_latency] [--fp8]` on one CPU rank (1-rank group,
    reference path) against the plain layer (with --fp8: its experts' input rounded through FP8 alike, so
    the fp32 tolerance holds; without that rounding the FP8 rows differ by about 3%)."""
    mode, _, fp8 = ep_mode.partition("-")
    cmd = [sys.executable, "-m", "moe_rt.demo_ep", "--framework", framework, "--tokens", "40", "--experts", "8",
           "--topk", "2", "--hidden", "200", "--ffn", "8", "--steps", "1", "--seed", "3", "--ep-mode", mode]
    cmd += ["--fp8"] if fp8 else []
    env = dict(os.environ, MOE_RT_DEMO_EP_CPU="1", RANK="0", WORLD_SIZE="1", JAX_PLATFORMS="cpu")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    print(r.stdout[-4000:], r.stderr[-4000:])
    assert r.returncode == 0
    assert r.stdout.count(" ok") == 7 and "FAIL" not in r.stdout
    assert ("low-latency mode" in r.stdout) == (mode == "low_latency")
    assert ("FP8 dispatch" in r.stdout) == bool(fp8)
