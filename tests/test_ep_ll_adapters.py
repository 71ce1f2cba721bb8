"""The low-latency EP mode in the framework adapters: moe_rt.torch.ll_dispatch / ll_combine (autograd.Function,
recv_x a view of the group's receive buffer guarded by its version counter) and moe_rt.jax.ll_dispatch /
ll_combine (custom_vjp; on the GPU XLA FFI custom calls, csrc/xla_ffi.c moe_rt_xla_ll_*, on the CPU
buffer_callback over the reference). One-rank groups on CPU (the NumPy reference behind the group) and on one
GPU, checked against the group's own ops and against the slot semantics written out in plain framework code;
the lowering for CUDA (checked on a CPU machine over a core group on a planning context); 2 and 4 ranks
(tests/ep_ll_worker.py jax); the demo's flag checks (its EP layer in low-latency mode:
tests/test_ep_adapters.py)."""
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

E, H, K, TMAX = 6, 20, 3, 13  # one rank: L = E local experts, slots [E, TMAX]


def _routing(rng, T, dup=True):
    """[T,K] ids: distinct experts per token, some -1, and (dup) a few tokens naming one expert twice."""
    idx = np.array([rng.permutation(E)[:K] for _ in range(T)], np.int32).reshape(T, K)
    idx[::4, -1] = -1
    if dup and T > 2:
        idx[1, 2] = idx[1, 0]
    return idx


# -- the slot semantics in plain torch (float64, differentiable; one rank) --------------------------------------

def _valid(idx):
    """[E, TMAX] bool: slot (l, t) holds token t (one rank)."""
    v = np.zeros((E, TMAX), bool)
    for t, k in zip(*np.nonzero(idx >= 0)):
        v[idx[t, k], t] = True
    return v


def plain_dispatch(x, idx, w):
    """(recv [E,TMAX,H], slot_w [E,TMAX]): slot (l, t) holds x[t] when token t names expert l (once, however
    many k name it), slot_w the sum of those k's weights."""
    T = x.shape[0]
    onehot = torch.zeros(T, K, E, dtype=x.dtype)
    valid = idx >= 0
    onehot[valid] = torch.nn.functional.one_hot(idx[valid].long(), E).to(x.dtype)
    present = onehot.amax(1)  # [T, E]
    recv = torch.zeros(E, TMAX, x.shape[1], dtype=x.dtype)
    recv[:, :T] = present.T[..., None] * x[None]
    slot_w = torch.zeros(E, TMAX, dtype=x.dtype)
    slot_w[:, :T] = (onehot * w[..., None]).sum(1).T
    return recv, slot_w


def plain_combine(y, idx, w):
    """out[t] = sum over k with idx[t,k] >= 0 of w[t,k] * y[idx[t,k], t]."""
    T = idx.shape[0]
    t = torch.arange(T)[:, None].expand(T, K)
    rows = y[idx.clamp(min=0).long(), t]  # [T, K, H]
    return ((idx >= 0).to(y.dtype) * w)[..., None].mul(rows).sum(1)


def _expert(recv, scale):
    """A per-expert scale (no saved recv_x: the multiplier does not require grad)."""
    return recv * scale[:, None, None]


# -- torch ---------------------------------------------------------------------------------------------------

TORCH_DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [0, 1, 11, TMAX])
def test_torch_ll_autograd_matches_core_and_plain(device, dtype, T, rng):
    tdt = getattr(torch, dtype)
    idx = _routing(rng, T)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    scale = rng.random(E).astype(np.float32) + 0.5
    g_out = rng.standard_normal((T, H)).astype(np.float32)
    g_sw = rng.standard_normal((E, TMAX)).astype(np.float32)
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype=dtype)
    xt = torch.tensor(x, device=device).to(tdt).requires_grad_()
    wt = torch.tensor(w, device=device, requires_grad=True)
    it = torch.tensor(idx, device=device)
    sc = torch.tensor(scale, device=device).to(tdt)
    rx, counts, h = mt.ll_dispatch(group, xt, it, wt)
    rx_host = rx.detach().float().cpu().numpy().copy()  # before combine's backward reuses the buffer
    assert isinstance(h, mt.TorchLLHandle) and rx.shape == (E, TMAX, H) and rx.dtype == tdt
    assert counts.dtype == torch.int32 and h.slot_topk.dtype == torch.int32
    assert rx.requires_grad and h.slot_weights.requires_grad and not h.slot_topk.requires_grad
    y = _expert(rx, sc)
    out = mt.ll_combine(h, y)
    loss = (out.float() * torch.tensor(g_out, device=device)).sum() + (h.slot_weights *
                                                                        torch.tensor(g_sw, device=device)).sum()
    loss.backward()

    # against the group's own ops on the same inputs (bitwise: the same core calls)
    r2, c2, core = group.dispatch(xt.detach(), it, wt.detach())
    valid = _valid(idx)
    np.testing.assert_array_equal(core.slot_topk.cpu().numpy() >= 0, valid)
    np.testing.assert_array_equal(counts.cpu().numpy(), c2.cpu().numpy())
    np.testing.assert_array_equal(h.slot_topk.cpu().numpy(), core.slot_topk.cpu().numpy())
    np.testing.assert_array_equal(rx_host[valid], r2.float().cpu().numpy()[valid])
    y2 = _expert(r2, sc).contiguous()
    np.testing.assert_array_equal(out.detach().float().cpu().numpy(),
                                  group.combine(core, y2).float().cpu().numpy())
    gy, gw_c = group.combine_bwd(core, torch.tensor(g_out, device=device).to(tdt), y2)
    gx_core, gw_d = group.dispatch_bwd(core, _expert(gy, sc).contiguous(), torch.tensor(g_sw, device=device))
    np.testing.assert_array_equal(xt.grad.float().cpu().numpy(), gx_core.float().cpu().numpy())
    np.testing.assert_allclose(wt.grad.cpu().numpy(), (gw_c + gw_d).cpu().numpy(), rtol=1e-6, atol=1e-6)

    # against the slot semantics in plain float64 torch autograd
    xd = torch.tensor(xt.detach().float().cpu().numpy(), dtype=torch.float64, requires_grad=True)
    wd = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    i64 = torch.tensor(idx)
    recv_p, sw_p = plain_dispatch(xd, i64, wd)
    out_p = plain_combine(_expert(recv_p, torch.tensor(sc.float().cpu().numpy(), dtype=torch.float64)), i64, wd)
    (out_p * torch.tensor(g_out, dtype=torch.float64)).sum().add((sw_p * torch.tensor(g_sw, dtype=torch.float64))
                                                                 .sum()).backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(rx_host[valid], recv_p.detach().numpy()[valid], **tol)
    np.testing.assert_allclose(h.slot_weights.detach().cpu().numpy(), sw_p.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out.detach().float().cpu().numpy(), out_p.detach().numpy(), **tol)
    np.testing.assert_allclose(xt.grad.float().cpu().numpy(), xd.grad.numpy(), **tol)
    np.testing.assert_allclose(wt.grad.cpu().numpy(), wd.grad.numpy(), **tol)


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [0, 1, 11, TMAX])
def test_torch_ll_fp8_dequantized_straight_through(device, dtype, T, rng):
    """ll_dispatch(..., fp8=True, dequantize=True): the rows the group's FP8 dispatch returns (quantize_fp8 then
    dequantize_fp8 of each token's row, bit for bit), gradients straight-through: x gets the float
    dispatch_bwd of recv_x's gradient, the weights theirs, as without FP8; a pre-quantized pair gives the
    same rows and no gradient to its codes."""
    tdt = getattr(torch, dtype)
    idx = _routing(rng, T)
    x = (rng.standard_normal((T, H)) * np.exp(rng.uniform(-3, 3, (T, 1)))).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    scale = rng.random(E).astype(np.float32) + 0.5
    g_out = rng.standard_normal((T, H)).astype(np.float32)
    g_sw = rng.standard_normal((E, TMAX)).astype(np.float32)
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype=dtype, fp8=True)
    xt = torch.tensor(x, device=device).to(tdt).requires_grad_()
    wt = torch.tensor(w, device=device, requires_grad=True)
    it = torch.tensor(idx, device=device)
    sc = torch.tensor(scale, device=device).to(tdt)
    rx, counts, h = mt.ll_dispatch(group, xt, it, wt, fp8=True, dequantize=True)
    rx_host = rx.detach().float().cpu().numpy().copy()
    assert rx.shape == (E, TMAX, H) and rx.dtype == tdt and rx.requires_grad
    out = mt.ll_combine(h, _expert(rx, sc))
    loss = (out.float() * torch.tensor(g_out, device=device)).sum() + (h.slot_weights *
                                                                        torch.tensor(g_sw, device=device)).sum()
    loss.backward()

    valid = _valid(idx)
    xq, xs = moe_rt.quantize_fp8(xt.detach())
    deq = moe_rt.dequantize_fp8(xq, xs, dtype=tdt).float().cpu().numpy()  # [T, H]: each token's row
    want = np.zeros((E, TMAX, H), np.float32)
    want[:, :T] = deq[None]
    np.testing.assert_array_equal(rx_host[valid], want[valid])
    r2, c2, core = group.dispatch(xt.detach(), it, wt.detach(), fp8=True, dequantize=True)
    np.testing.assert_array_equal(rx_host[valid], r2.float().cpu().numpy()[valid])
    np.testing.assert_array_equal(counts.cpu().numpy(), c2.cpu().numpy())
    y2 = _expert(r2, sc).contiguous()
    np.testing.assert_array_equal(out.detach().float().cpu().numpy(), group.combine(core, y2).float().cpu().numpy())
    gy, gw_c = group.combine_bwd(core, torch.tensor(g_out, device=device).to(tdt), y2)
    gx_core, gw_d = group.dispatch_bwd(core, _expert(gy, sc).contiguous(), torch.tensor(g_sw, device=device))
    np.testing.assert_array_equal(xt.grad.float().cpu().numpy(), gx_core.float().cpu().numpy())
    np.testing.assert_allclose(wt.grad.cpu().numpy(), (gw_c + gw_d).cpu().numpy(), rtol=1e-6, atol=1e-6)

    # the pre-quantized pair: the same rows; the codes take no gradient, the weights theirs
    wt2 = torch.tensor(w, device=device, requires_grad=True)
    rx2, _, h2 = mt.ll_dispatch(group, (xq, xs), it, wt2, fp8=True, dequantize=True)
    np.testing.assert_array_equal(rx2.detach().float().cpu().numpy()[valid], want[valid])
    (h2.slot_weights * torch.tensor(g_sw, device=device)).sum().backward()
    _, gw_p = group.dispatch_bwd(core, torch.zeros_like(r2), torch.tensor(g_sw, device=device))
    np.testing.assert_allclose(wt2.grad.cpu().numpy(), gw_p.cpu().numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_ll_fp8_flags_refused(fw, rng):
    """The adapters' FP8 flags: the differentiable form only (fp8 with dequantize), a group with FP8 buffers; torch
    also takes a pre-quantized pair (its arity and flag checked as the group checks them), JAX a float x only."""
    mod, arr = (mt, torch.tensor) if fw == "torch" else (mj, jnp.asarray)
    idx, x = arr(_routing(rng, 5)), arr(rng.standard_normal((5, H)).astype(np.float32))
    w = arr(rng.random((5, K)).astype(np.float32))
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32", fp8=True)
    plain = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32")
    xq, xs = moe_rt.quantize_fp8(x)
    cases = [((group, x), dict(fp8=True), ValueError, r"LowLatencyGroup\.dispatch\(x, topk_idx, topk_weights, fp8=True\)"),
             ((group, x), dict(dequantize=True), ValueError, "dequantize: only meaningful with fp8=True"),
             ((group, x), dict(fp8=1, dequantize=True), TypeError, "fp8: expected a bool"),
             ((plain, x), dict(fp8=True, dequantize=True), ValueError, "no FP8 receive buffers")]
    if fw == "torch":
        cases += [((group, (xq, xs)), {}, TypeError, "pass fp8=True"),
                  ((group, (xq, xs, xs)), dict(fp8=True, dequantize=True), TypeError,
                   "an array \\[T,H\\] or an \\(x_fp8, scales\\) pair")]
    else:
        cases += [((group, (xq, xs)), dict(fp8=True, dequantize=True), TypeError, "a float array")]
    for (g, xin), kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            mod.ll_dispatch(g, xin, idx, w, **kw)


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_ll_combine_partials_group(device, dtype, rng):
    """A group made with combine_partials=True: moe_rt.torch.ll_combine takes the group's rank-partial combine
    (bitwise the reference's); its gradients are a plain group's (the backward passes do not depend on it)."""
    from moe_rt.reference import ep_ll as ref

    T, tdt = 11, getattr(torch, dtype)
    idx = _routing(rng, T)
    x = torch.tensor(rng.standard_normal((T, H)), device=device).to(tdt)
    w = rng.random((T, K)).astype(np.float32)
    y = torch.tensor(rng.standard_normal((E, TMAX, H)), device=device).to(tdt)
    g_out = torch.tensor(rng.standard_normal((T, H)), device=device).to(tdt)
    grads = []
    for partials in (True, False):
        group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype=dtype, combine_partials=partials)
        wt = torch.tensor(w, device=device, requires_grad=True)
        _, _, h = mt.ll_dispatch(group, x, torch.tensor(idx, device=device), wt)
        yt = y.clone().requires_grad_()
        out = mt.ll_combine(h, yt)
        (out.float() * g_out.float()).sum().backward()
        grads.append((yt.grad.float().cpu().numpy(), wt.grad.cpu().numpy()))
        if partials:
            xs = [x.float().cpu().numpy().astype(ref_dt(dtype))]
            rh = ref.dispatch(xs, [idx], [w], E, TMAX)[0][2]
            want = ref.combine_partials([rh], [y.float().cpu().numpy().astype(ref_dt(dtype))])[0]
            np.testing.assert_array_equal(out.detach().float().cpu().numpy(), want.astype(np.float32))
    np.testing.assert_array_equal(grads[0][0], grads[1][0])
    np.testing.assert_array_equal(grads[0][1], grads[1][1])


def ref_dt(dtype):
    import ml_dtypes

    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


@pytest.mark.parametrize("device", TORCH_DEVICES)
def test_torch_ll_identity_expert(device, rng):
    """expert_out = recv_x itself: combine's backward copies it before the group overwrites the buffer."""
    T = 9
    idx = _routing(rng, T)
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32")
    x = torch.tensor(rng.standard_normal((T, H)).astype(np.float32), device=device, requires_grad=True)
    w = torch.tensor(rng.random((T, K)).astype(np.float32), device=device, requires_grad=True)
    g = torch.tensor(rng.standard_normal((T, H)).astype(np.float32), device=device)
    rx, _, h = mt.ll_dispatch(group, x, torch.tensor(idx, device=device), w)
    (mt.ll_combine(h, rx) * g).sum().backward()
    valid = torch.tensor(idx >= 0, device=device)
    # out[t] = x[t] * sum_k w[t,k] (valid k); grad x = g * sum_k w; grad w[t,k] = <x[t], g[t]>
    torch.testing.assert_close(x.grad, g * (w.detach() * valid).sum(1, keepdim=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, (x.detach() * g).sum(1, keepdim=True) * valid, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", TORCH_DEVICES)
def test_torch_ll_saved_recv_x_raises(device, rng):
    """An expert that saves recv_x for its backward is caught: combine's backward writes the expert outputs'
    gradient into the receive buffer and bumps its version, so autograd refuses the stale view; a copy
    (torch.where with the validity mask) trains."""
    T = 7
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32")
    x = torch.randn(T, H, device=device, requires_grad=True)
    w = torch.rand(T, K, device=device, requires_grad=True)
    idx = torch.tensor(_routing(rng, T), device=device)
    wexp = torch.randn(E, H, H, device=device, requires_grad=True)
    rx, _, h = mt.ll_dispatch(group, x, idx, w)
    out = mt.ll_combine(h, torch.bmm(rx, wexp))  # bmm saves rx for wexp's gradient
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    # a later dispatch invalidates the first one's recv_x as well
    rx, _, h = mt.ll_dispatch(group, x, idx, w)
    y = torch.bmm(rx, wexp)
    mt.ll_dispatch(group, x, idx, w)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    # the documented patterns: run the expert on a copy with zero rows at empty slots
    rx, _, h = mt.ll_dispatch(group, x, idx, w)
    rows = torch.where(h.slot_topk[..., None] >= 0, rx, 0)
    mt.ll_combine(h, torch.bmm(rows, wexp)).sum().backward()
    g_where = [t.grad.clone() for t in (x, w, wexp)]
    for t in (x, w, wexp):
        t.grad = None
    rows, _, h = mt.ll_dispatch(group, x, idx, w, copy=True)
    assert rows.data_ptr() != rx.data_ptr() and not rows[h.slot_topk < 0].any()
    torch.testing.assert_close(rows, torch.where(h.slot_topk[..., None] >= 0, rx, 0))
    mt.ll_combine(h, torch.bmm(rows, wexp)).sum().backward()
    for t, g in zip((x, w, wexp), g_where):
        torch.testing.assert_close(t.grad, g)
        assert torch.isfinite(t.grad).all()


def test_torch_ll_recv_view_version_mechanism():
    """The mechanism itself: every dispatch-direction write hands out a new alias of the group's one buffer
    tensor (per buffer set) after bumping the version counter they all share."""
    from moe_rt._torch_ep import _ll_buffers, _ll_recv_view

    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32")
    fresh = torch.randn(E, TMAX, H)
    a = _ll_recv_view(group, 0, fresh)
    v = a._version
    b = _ll_recv_view(group, 0, fresh * 2)
    assert a.data_ptr() == b.data_ptr() == _ll_buffers(group).tensors[0].data_ptr()
    assert a._version == b._version == v + 2  # the copy and the explicit bump
    torch.testing.assert_close(a, fresh * 2)  # the same memory
    with torch.inference_mode():
        c = _ll_recv_view(group, 0, fresh)
    assert not c.is_inference() and c._version == v + 4


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("num_buffers", [1, 2])
def test_torch_ll_buffer_sets(device, num_buffers, rng):
    """With num_buffers=2 a second dispatch leaves the first one's recv_x alone (the sets alternate, on CPU
    as on the GPU); with 1 it rewrites it (a new version). Either way combine's backward rewrites the
    handle's own set, so an expert that saved recv_x is reported."""
    T = 6
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32", num_buffers=num_buffers)
    idx = torch.tensor(_routing(rng, T), device=device)
    w = torch.rand(T, K, device=device, requires_grad=True)
    wexp = torch.randn(E, H, H, device=device, requires_grad=True)
    x1, x2 = (torch.randn(T, H, device=device, requires_grad=True) for _ in range(2))
    rx1, _, h1 = mt.ll_dispatch(group, x1, idx, w)
    first, v1 = rx1.detach().clone(), rx1._version
    y1 = mt.ll_combine(h1, torch.bmm(rx1, wexp))  # saves rx1
    rx2, _, h2 = mt.ll_dispatch(group, x2, idx, w)
    valid = h1.slot_topk >= 0
    if num_buffers == 2:
        assert (h1.buffer_set, h2.buffer_set) == (0, 1) and rx1.data_ptr() != rx2.data_ptr()
        assert rx1._version == v1
        torch.testing.assert_close(rx1[valid], first[valid])
    else:
        assert (h1.buffer_set, h2.buffer_set) == (0, 0) and rx1.data_ptr() == rx2.data_ptr()
        assert rx1._version > v1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y1.sum().backward()


def test_torch_ll_bad_input_same_messages_as_core(rng):
    T = 5
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32")
    x, idx, w = torch.randn(T, H), torch.tensor(_routing(rng, T)), torch.rand(T, K)
    with pytest.raises(TypeError, match="LowLatencyGroup"):
        mt.ll_dispatch(moe_rt.EpGroup(None, E, H, 8), x, idx, w)
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        mt.ll_dispatch(group, x.numpy(), idx, w)
    with pytest.raises(TypeError, match="topk_weights"):
        mt.ll_dispatch(group, x, idx, None)
    bad = [(x[:, 1:], idx, w), (x, idx[:, :2], w[:, :2]), (x.double(), idx, w), (x, idx.float(), w),
           (x, idx, w[:, :2]), (torch.randn(TMAX + 1, H), torch.zeros(TMAX + 1, K, dtype=torch.int32),
                                 torch.rand(TMAX + 1, K)), (x, idx + E, w)]
    for args in bad:
        with pytest.raises((TypeError, ValueError)) as core:
            group.dispatch(*args)
        with pytest.raises(core.type) as ours:
            mt.ll_dispatch(group, *args)
        assert str(ours.value) == str(core.value)
    rx, _, h = mt.ll_dispatch(group, x, idx, w)
    with pytest.raises(TypeError, match="TorchLLHandle"):
        mt.ll_combine(h.core, rx)
    with pytest.raises(ValueError) as core:
        group.combine(h.core, rx[:, 1:])
    with pytest.raises(ValueError) as ours:
        mt.ll_combine(h, rx[:, 1:])
    assert str(ours.value) == str(core.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("H", [1, 3, 8, 33, 1000])
@pytest.mark.parametrize("zero_rest", [True, False])
def test_copy_kept_rows_gpu(dtype, H, zero_rest, rng):
    """The kernel behind JAX's recv_x copy: kept rows copied, the others zeroed or left as they were (odd
    row sizes pick every unit width; the output is poisoned first)."""
    cp = pytest.importorskip("cupy")
    from moe_rt import permutation

    shape = (5, 37, H)
    src_np = (rng.standard_normal(shape) * 50).astype(dtype)
    keep_np = np.where(rng.random(shape[:2]) < 0.4, rng.integers(0, 4, shape[:2]), -1).astype(np.int32)
    src, keep = cp.asarray(src_np), cp.asarray(keep_np)
    poison = np.full(shape, 7, dtype)
    out = cp.asarray(poison)
    permutation.copy_kept_rows(src, out, keep, zero_rest=zero_rest, device_id=src.device.id,
                               stream=cp.cuda.get_current_stream())
    want = np.where(keep_np[..., None] >= 0, src_np, np.zeros_like(src_np) if zero_rest else poison)
    np.testing.assert_array_equal(out.get(), want)


# -- JAX -----------------------------------------------------------------------------------------------------

JAX_DEVICES = [pytest.param("cpu"), pytest.param("gpu", marks=pytest.mark.gpu)]


def _jax_plain_loss(x, w, idx, scale, g_out, g_sw):
    """The same layer as plain jnp math (one rank): dispatch to slots, scale, weighted combine."""
    T = x.shape[0]
    onehot = jax.nn.one_hot(jnp.where(idx >= 0, idx, E), E + 1)[..., :E]  # [T,K,E]
    present = onehot.max(1)
    recv = jnp.zeros((E, TMAX, H), x.dtype).at[:, :T].set(present.T[..., None] * x[None])
    slot_w = jnp.zeros((E, TMAX), w.dtype).at[:, :T].set((onehot * w[..., None]).sum(1).T)
    y = recv * scale[:, None, None]
    rows = y[jnp.maximum(idx, 0), jnp.arange(T)[:, None]]
    out = ((idx >= 0) * w)[..., None].__mul__(rows).sum(1)
    return (out * g_out).sum() + (slot_w * g_sw).sum(), (out, recv, slot_w)


@pytest.mark.parametrize("device", JAX_DEVICES)
@pytest.mark.parametrize("T", [0, 1, 11, TMAX])
@pytest.mark.parametrize("remat", [False, True])
def test_jax_ll_jit_grad_matches_core_and_plain(device, T, remat, rng):
    idx = _routing(rng, T)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    scale = (rng.random(E) + 0.5).astype(np.float32)
    g_out = rng.standard_normal((T, H)).astype(np.float32)
    g_sw = rng.standard_normal((E, TMAX)).astype(np.float32)
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32")
    with jax.default_device(jax.devices(device)[0]):
        def loss(x, w):
            rx, counts, h = mj.ll_dispatch(group, x, jnp.asarray(idx), w)
            out = mj.ll_combine(h, rx * jnp.asarray(scale)[:, None, None])
            return (out * g_out).sum() + (h.slot_weights * g_sw).sum(), (out, rx, counts, h)

        f = jax.checkpoint(loss) if remat else loss
        (_, (out, rx, counts, h)), (gx, gw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
            jnp.asarray(x), jnp.asarray(w))
        (_, (out_p, recv_p, sw_p)), (gx_p, gw_p) = jax.value_and_grad(_jax_plain_loss, argnums=(0, 1),
                                                                       has_aux=True)(
            jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx), jnp.asarray(scale), g_out, g_sw)
    assert isinstance(h, mj.JaxLLHandle) and rx.shape == (E, TMAX, H)
    leaves, tree = jax.tree_util.tree_flatten(h)
    assert [np.dtype(a.dtype) for a in leaves] == [np.int32, np.float32, np.int32, np.int32, np.float32, np.int32]
    assert jax.tree_util.tree_unflatten(tree, leaves).static == h.static == (h.group_id, T, K)
    # the group's own ops (the reference, as NumPy), bit for bit
    r_ref, c_ref, core = group.dispatch(x, idx, w)
    np.testing.assert_array_equal(np.asarray(counts), c_ref)
    np.testing.assert_array_equal(np.asarray(h.slot_topk), core.slot_topk)
    np.testing.assert_array_equal(np.asarray(h.slot_weights), core.slot_weights)
    np.testing.assert_array_equal(np.asarray(rx), r_ref)  # empty slots zero (zero_empty_slots=True)
    y = (r_ref * scale[:, None, None]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out), group.combine(core, y))
    gy, gw_c = group.combine_bwd(core, g_out, y)
    gx_core, gw_d = group.dispatch_bwd(core, (gy * scale[:, None, None]).astype(np.float32), g_sw)
    np.testing.assert_array_equal(np.asarray(gx), gx_core)
    np.testing.assert_allclose(np.asarray(gw), gw_c + gw_d, rtol=1e-6, atol=1e-6)
    # the slot semantics as plain jnp
    for a, b in ((rx, recv_p), (h.slot_weights, sw_p), (out, out_p), (gx, gx_p), (gw, gw_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", JAX_DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_ll_combine_partials_group(device, dtype, rng):
    """A group made with combine_partials=True: moe_rt.jax.ll_combine (jit; on the GPU the XLA custom call, whose
    core group carries the setting) is the group's rank-partial combine, bitwise the reference's."""
    from moe_rt.reference import ep_ll as ref

    T = 11
    idx = _routing(rng, T)
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype=dtype, combine_partials=True)
    with jax.default_device(jax.devices(device)[0]):
        x = jnp.asarray(rng.standard_normal((T, H)), getattr(jnp, dtype))
        w = jnp.asarray(rng.random((T, K)).astype(np.float32))
        y = jnp.asarray(rng.standard_normal((E, TMAX, H)), getattr(jnp, dtype))
        out = jax.jit(lambda x, w, y: mj.ll_combine(mj.ll_dispatch(group, x, jnp.asarray(idx), w)[2], y))(x, w, y)
    rh = ref.dispatch([np.asarray(x)], [idx], [np.asarray(w)], E, TMAX)[0][2]
    want = ref.combine_partials([rh], [np.asarray(y)])[0]
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("device", JAX_DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_ll_forward_bf16_and_unspecified_empty_slots(device, dtype, rng):
    """bf16 through the adapter equals the group's op; zero_empty_slots=False leaves the valid rows and the
    combine unchanged."""
    T = 10
    idx = _routing(rng, T)
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype=dtype)
    with jax.default_device(jax.devices(device)[0]):
        x = jnp.asarray(rng.standard_normal((T, H)), getattr(jnp, dtype))
        w = jnp.asarray(rng.random((T, K)).astype(np.float32))
        outs = []
        for zero in (True, False):
            fn = jax.jit(lambda x, w, zero=zero: (lambda r: (r[0], mj.ll_combine(r[2], r[0] * 2)))(
                mj.ll_dispatch(group, x, jnp.asarray(idx), w, zero_empty_slots=zero)))
            outs.append(fn(x, w))
    valid = _valid(idx)
    r_ref, _, core = group.dispatch(np.asarray(x), idx, np.asarray(w))
    for rx, out in outs:
        np.testing.assert_array_equal(np.asarray(rx)[valid], np.asarray(r_ref)[valid])
        np.testing.assert_array_equal(np.asarray(out), np.asarray(group.combine(core, np.asarray(r_ref) * 2)))
    assert not np.asarray(outs[0][0], np.float32)[~valid].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hidden", [("bfloat16", 768), ("float32", 384)])
def test_jax_ll_dispatch_rows_output_the_size_of_the_handle_tables(dtype, hidden):
    """E = K = Tmax = T = 1: recv_x's bytes (H * itemsize = 1536) equal those of the one allocation holding the
    group's own handle tables (each 4 bytes at a 256-byte boundary); the custom call's outputs are XLA's
    buffers, recv_x among them, and every output equals the CPU path's (a regression test from the callback
    path, which served allocations of an output's size from that output's buffer)."""
    idx = np.zeros((1, 1), np.int32)
    x = (np.arange(hidden, dtype=np.float32) / 7 - 20).reshape(1, hidden)
    w = np.full((1, 1), 0.75, np.float32)
    res = {}
    for device in ("cpu", "gpu"):
        group = moe_rt.LowLatencyGroup(None, 1, hidden, 1, topk=1, dtype=dtype)
        with jax.default_device(jax.devices(device)[0]):
            xj = jnp.asarray(x, getattr(jnp, dtype))
            rx, counts, h = jax.jit(lambda x, w, group=group: mj.ll_dispatch(group, x, jnp.asarray(idx), w))(
                xj, jnp.asarray(w))
            out = jax.jit(mj.ll_combine)(h, rx * 2)
            res[device] = [np.asarray(a) for a in (rx, counts, out, *jax.tree_util.tree_leaves(h))]
    for a, b in zip(res["gpu"], res["cpu"]):
        np.testing.assert_array_equal(a, b)
    assert res["gpu"][1].tolist() == [1]


def test_jax_ll_bad_input_same_messages_as_core(rng):
    T = 5
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32")
    x, idx, w = (rng.standard_normal((T, H)).astype(np.float32), _routing(rng, T),
                 rng.random((T, K)).astype(np.float32))
    with pytest.raises(TypeError, match="LowLatencyGroup"):
        mj.ll_dispatch(moe_rt.EpGroup(None, E, H, 8), x, idx, w)
    with pytest.raises(ValueError, match="num_buffers=1"):
        mj.ll_dispatch(moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32", num_buffers=2), x, idx, w)
    bad = [(x[:, 1:], idx, w), (x, idx[:, :2], w[:, :2]), (x.astype(np.float16), idx, w),
           (x, idx.astype(np.float32), w), (x, idx, w[:, :2]), (x, idx, None),
           (np.zeros((TMAX + 1, H), np.float32), np.zeros((TMAX + 1, K), np.int32), np.ones((TMAX + 1, K), np.float32))]
    with jax.default_device(jax.devices("cpu")[0]):
        for args in bad:
            with pytest.raises((TypeError, ValueError)) as core:
                group.dispatch(*args)
            with pytest.raises(core.type) as ours:
                jax.jit(lambda *a: mj.ll_dispatch(group, *a)[0])(*args)
            assert str(ours.value) == str(core.value)
        rx, _, h = mj.ll_dispatch(group, x, idx, w)
        with pytest.raises(TypeError, match="JaxLLHandle"):
            mj.ll_combine(None, rx)
        with pytest.raises(ValueError, match="expert_out: expected shape"):
            mj.ll_combine(h, rx[:, 1:])


def _lowered_for_cuda(monkeypatch, group, T, dtype="bfloat16", fp8=False):
    """The LL layer (forward and grad) lowered for CUDA on this machine: the group's core group on a planning
    context (made-up buffer addresses; listed in the core's registry as any group), one stand-in CUDA device,
    and the preparation of XLA's kernels recorded instead of run. Returns (HLO text, prepared calls, core)."""
    from moe_rt import _xla
    from test_ep_ll_core import Group

    pg = Group(R=1, me=0, L=E, Tmax=TMAX, K=K, H=H, dtype=dtype, num_buffers=1, fp8=fp8)
    class Transport:  # the direct transport _setup makes (nothing to close here)
        def close(self):
            pass

    group._llg, group._transport, group.device = pg.g, Transport(), 0  # what _setup and _core_group make

    class Device:
        compute_capability = "9.0"
        local_hardware_id = 0

    prepared = []
    monkeypatch.setattr(_xla, "cuda_devices", lambda: [Device()])
    monkeypatch.setattr(_xla, "prepare", lambda op, **kw: prepared.append((op, kw)))

    def loss(x, w, idx):
        rx, counts, h = mj.ll_dispatch(group, x, idx, w, fp8=fp8, dequantize=fp8)
        out = mj.ll_combine(h, rx * 2)
        return (out.astype(jnp.float32) ** 2).sum() + (h.slot_weights ** 2).sum()

    args = (jnp.zeros((T, H), getattr(jnp, dtype)), jnp.zeros((T, K), jnp.float32), jnp.zeros((T, K), jnp.int32))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text, prepared, pg


def test_jax_ll_lowers_to_custom_calls_naming_the_core_group(monkeypatch):
    import re

    from moe_rt import _xla

    T = 11
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="bfloat16")
    text, prepared, pg = _lowered_for_cuda(monkeypatch, group, T)
    assert "xla_buffer_python" not in text  # no Python callback left
    calls = {}
    for m in re.finditer(r"stablehlo\.custom_call @(\w+)\(([^)]*)\) \{[^\n]*?mhlo\.backend_config = \{([^}]*)\}"
                         r"[^\n]*-> \(?([^\n]*)", text):
        attrs = dict(kv.strip().split(" = ", 1) for kv in m.group(3).split(","))
        calls.setdefault(m.group(1), []).append((attrs, len(m.group(2).split(",")), m.group(4)))
    group_attrs = {"device": "0 : i32", "group": f"{pg.g.address} : i64", "group_serial": f"{pg.g.serial} : i64"}
    for op, n_in, n_out in (("ll_dispatch", 3, 7), ("ll_combine", 7, 1), ("ll_dispatch_bwd", 8, 2),
                            ("ll_combine_bwd", 8, 3)):
        (attrs, got_in, results), = calls[_xla.target(op)]
        want = dict(group_attrs, **({"zero_empty_slots": "1 : i32", "fp8": "0 : i32"} if op == "ll_dispatch" else {}))
        assert attrs == want, (op, attrs)
        assert got_in == n_in and results.count("tensor<") == n_out, (op, got_in, results)
    # the receive rows [L, R*Tmax, H] and the handle's tables come from XLA; combine_bwd's dots are a result
    assert f"tensor<{E}x{TMAX}x{H}xbf16>" in calls["moe_rt_ll_dispatch"][0][2]
    assert f"tensor<{E * TMAX}xf32>" in calls["moe_rt_ll_combine_bwd"][0][2]
    assert "input_output_aliases" not in text  # no aliasing: every result is a buffer of its own
    # XLA's context gets the copy of the receive rows (the group's own context its ops' kernels)
    assert prepared and {op for op, _ in prepared} == {"copy_kept_rows"}
    assert prepared[0][1] == dict(N=E * TMAX, row_bytes=H * 2, zero_rest=1)


def test_jax_ll_fp8_lowers_with_the_fp8_attribute(monkeypatch):
    """ll_dispatch(..., fp8=True, dequantize=True) lowered for CUDA: the dispatch custom call carries fp8 = 1 (the
    handler passes it to moe_rt_ll_dispatch as fp8 and dequantize); its VJP is the float one."""
    import re

    from moe_rt import _xla

    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="bfloat16", fp8=True)
    text, _, pg = _lowered_for_cuda(monkeypatch, group, 9, fp8=True)
    found = re.findall(r"stablehlo\.custom_call @(\w+)\([^)]*\) \{[^\n]*?mhlo\.backend_config = \{([^}]*)\}", text)
    attrs = [dict(kv.strip().split(" = ", 1) for kv in a.split(",")) for t, a in found if t == _xla.target("ll_dispatch")]
    assert len(attrs) == 1 and attrs[0]["fp8"] == "1 : i32" and attrs[0]["zero_empty_slots"] == "1 : i32"
    assert [t for t, _ in found].count(_xla.target("ll_dispatch_bwd")) == 1


@pytest.mark.parametrize("device", JAX_DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_ll_fp8_dequantized_straight_through(device, dtype, rng):
    """jit(grad) through ll_dispatch(..., fp8=True, dequantize=True): recv_x is each token's row quantized and
    dequantized (bit for bit), zero at empty slots; the gradients are those of the float dispatch for the same
    cotangents (straight-through)."""
    T = 11
    idx = _routing(rng, T)
    x = (rng.standard_normal((T, H)) * np.exp(rng.uniform(-3, 3, (T, 1)))).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    g_rx = rng.standard_normal((E, TMAX, H)).astype(np.float32)
    g_out = rng.standard_normal((T, H)).astype(np.float32)
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype=dtype, fp8=True)
    jdt = getattr(jnp, dtype)
    with jax.default_device(jax.devices(device)[0]):
        xj, wj, ij = jnp.asarray(x, jdt), jnp.asarray(w), jnp.asarray(idx)

        def loss(x, w, fp8):
            rx, _, h = mj.ll_dispatch(group, x, ij, w, fp8=fp8, dequantize=fp8)
            out = mj.ll_combine(h, rx * 2)
            return ((rx.astype(jnp.float32) * g_rx).sum() + (out.astype(jnp.float32) * g_out).sum(), rx)

        (_, rx8), g8 = jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, True), argnums=(0, 1), has_aux=True))(xj, wj)
        rx8 = np.asarray(rx8, np.float32)
        # straight-through: the float path's gradients for the same cotangents (the quantized rows enter only
        # combine's weight gradient, so take the combine term at the FP8 rows for both)
        (_, _), gf = jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, False), argnums=(0, 1), has_aux=True))(xj, wj)
    valid = _valid(idx)
    q, s = moe_rt.quantize_fp8(np.asarray(xj))
    deq = np.asarray(moe_rt.dequantize_fp8(q, s, dtype=np.dtype(jdt)), np.float32)
    want = np.zeros((E, TMAX, H), np.float32)
    want[:, :T] = deq[None]
    np.testing.assert_array_equal(rx8[valid], want[valid])
    assert not rx8[~valid].any()
    np.testing.assert_array_equal(np.asarray(g8[0], np.float32), np.asarray(gf[0], np.float32))
    # the weights' gradient: combine's takes the rows it was given (FP8-rounded here), so compare with tolerance
    np.testing.assert_allclose(np.asarray(g8[1]), np.asarray(gf[1]), rtol=0.1, atol=0.1 * float(np.abs(gf[1]).max()))


def test_jax_ll_ops_chained_in_program_order(monkeypatch):
    """The four collectives of a lowered layer (forward and VJPs) carry one token in program order, each
    side-effecting (tests/test_jax_ep_ffi.py collective_chain), so every rank runs them in the same order."""
    from test_jax_ep_ffi import collective_chain

    from moe_rt import _xla

    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="bfloat16")
    text, _, _ = _lowered_for_cuda(monkeypatch, group, 5)
    ops = ["ll_dispatch", "ll_combine", "ll_combine_bwd", "ll_dispatch_bwd"]
    assert collective_chain(text, {_xla.target(op) for op in ops}) == [_xla.target(op) for op in ops]


def test_jax_ll_ops_run_on_a_rank_without_tokens():
    """A rank with no tokens still takes part in each of the four collectives of a step (XLA would drop
    them: their results hold no element or go unused)."""
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32")
    calls = []
    for name in ("dispatch", "combine", "dispatch_bwd", "combine_bwd"):
        def counted(*a, _op=getattr(group, name), _name=name, **kw):
            calls.append(_name)
            return _op(*a, **kw)
        setattr(group, name, counted)

    def loss(x, w, idx):
        rx, _, h = mj.ll_dispatch(group, x, idx, w)
        return (mj.ll_combine(h, rx * 2) ** 2).sum()

    args = (jnp.zeros((0, H), jnp.float32), jnp.zeros((0, K), jnp.float32), jnp.zeros((0, K), jnp.int32))
    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for _ in range(2):
        calls.clear()
        jax.block_until_ready(step(*args))
        assert sorted(calls) == ["combine", "combine_bwd", "dispatch", "dispatch_bwd"], calls


def test_jax_ll_group_kept_until_close_then_refused(monkeypatch):
    """moe_rt.jax keeps the group alive (a traced program names it) until close; after close tracing refuses it
    with a clear error (and the core's registry no longer lists its core group: a compiled program naming it
    fails in the handler, tests/test_jax_ffi.py test_ll_handlers_with_hand_built_call_frames)."""
    import ctypes
    import gc
    import weakref

    from moe_rt import ep_ll

    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="bfloat16")
    _, _, pg = _lowered_for_cuda(monkeypatch, group, 4)
    ref_ = weakref.ref(group)
    gid = group.id
    del group
    gc.collect()
    assert ref_() is not None and ep_ll.adopted(gid) is ref_()  # held for the programs that name it
    address, serial = pg.g.address, pg.g.serial
    lib = _lib_registry()
    held = ctypes.c_void_p()
    assert lib.moe_rt_ll_group_acquire(address, serial, ctypes.byref(held)) == 0 and held.value == address
    lib.moe_rt_ll_group_release(held)
    group = ref_()
    group.close()
    assert lib.moe_rt_ll_group_acquire(address, serial, ctypes.byref(held)) == 1
    assert b"no live low-latency group" in lib.moe_rt_last_error()
    with pytest.raises(ValueError, match=f"low-latency group {gid} is closed"):
        ep_ll.adopted(gid)
    with jax.default_device(jax.devices("cpu")[0]):
        with pytest.raises(ValueError, match="closed"):
            mj.ll_dispatch(group, np.zeros((2, H), np.float32), np.zeros((2, K), np.int32),
                           np.ones((2, K), np.float32))
    del group
    gc.collect()
    assert ref_() is None  # released by close


def _lib_registry():
    import ctypes

    from moe_rt import _core

    lib = ctypes.CDLL(_core.LIB_PATH)
    lib.moe_rt_last_error.restype = ctypes.c_char_p
    lib.moe_rt_ll_group_acquire.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.moe_rt_ll_group_release.argtypes = [ctypes.c_void_p]
    return lib


@pytest.mark.gpu
def test_jax_ll_gpu_runs_custom_calls_and_refuses_a_closed_group(rng):
    """On one GPU the jitted layer lowers to the moe_rt_ll_* custom calls (no Python callback), runs, and the
    same compiled program fails with the core's message once the group is closed; that error fails the next
    program with EP ops until moe_rt.jax.reset_ep_order()."""
    T = 9
    idx = _routing(rng, T)
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32")
    with jax.default_device(jax.devices("gpu")[0]):
        x = jnp.asarray(rng.standard_normal((T, H)).astype(np.float32))
        w = jnp.asarray(rng.random((T, K)).astype(np.float32))

        def loss(x, w):
            rx, _, h = mj.ll_dispatch(group, x, jnp.asarray(idx), w)
            return (mj.ll_combine(h, rx * 2) ** 2).sum()

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        text = step.lower(x, w).as_text()
        assert "xla_buffer_python" not in text
        for op in ("ll_dispatch", "ll_combine", "ll_dispatch_bwd", "ll_combine_bwd"):
            assert f"@moe_rt_{op}(" in text, op
        jax.block_until_ready(step(x, w))
        group.close()
        with pytest.raises(Exception, match="closed") as e:  # XLA's error type varies with the version
            jax.block_until_ready(step(x, w))
        assert "no live low-latency group" in str(e.value)
        # the failure stays in the EP ops' ordered-effect token: a program over a new group fails with it
        # until moe_rt.jax.reset_ep_order()
        group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32")
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        with pytest.raises(Exception, match="no live low-latency group"):
            jax.block_until_ready(step(x, w))
        mj.reset_ep_order()
        jax.block_until_ready(step(x, w))
        group.close()


@pytest.mark.multi_gpu
@pytest.mark.parametrize("n", [2, 4])
def test_multi_gpu_jax_ll_jit_grad_matches_reference(n):
    """moe_rt.jax ll_dispatch / ll_combine under jit and grad on n ranks (tests/ep_ll_worker.py jax) against
    the NumPy R-rank reference, run to run bitwise, and refused after close."""
    from test_ep_ll import _run_worker

    r = _run_worker("jax", n, timeout=480)
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout


# -- the demo's EP layer in low-latency mode ----------------------------------------------------------------------

def test_demo_low_latency_flag_checks():
    from moe_rt import demo

    for argv, msg in ((["--ep-mode", "low_latency"], "--ep N"),
                      (["--ep", "2", "--ep-mode", "low_latency", "--tokens", "1025"], "1024"),
                      (["--fp8"], "--fp8")):
        r = subprocess.run([sys.executable, "-m", "moe_rt", "demo", "--cpu"] + argv, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr + r.stdout, (argv, r.stdout, r.stderr)
    assert "low_latency" in demo.parser().format_help()


def test_torch_ll_under_torch_compile_runs_outside_the_graph(rng):
    """ll_dispatch / ll_combine are eager-only (torch.compiler.disable): a compiled layer around them (graph
    breaks) gives the eager results and gradients."""
    T = 8
    group = moe_rt.LowLatencyGroup(None, E, H, TMAX, topk=K, dtype="float32")
    idx = torch.tensor(_routing(rng, T))
    x = torch.randn(T, H, requires_grad=True)
    w = torch.rand(T, K, requires_grad=True)

    def layer(x, w):
        rows, _, h = mt.ll_dispatch(group, torch.nn.functional.silu(x), idx, w, copy=True)
        return mt.ll_combine(h, rows.square()) * 2

    eager = layer(x, w)
    ge = torch.autograd.grad(eager.sum(), [x, w])
    compiled = torch.compile(layer, backend="aot_eager")(x, w)
    gc = torch.autograd.grad(compiled.sum(), [x, w])
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)
