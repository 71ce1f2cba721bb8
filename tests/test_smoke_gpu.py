"""GPU smoke tests of the foundation: a registry kernel launched on torch's current stream, on a CuPy
stream and inside jax.jit (XLA's stream, through buffer_callback); bf16 in and out with no copy."""
import numpy as np
import pytest

from moe_rt import _arrays, _common_ops

pytestmark = pytest.mark.gpu

ALPHA = 1.5


def _expected(x32):
    return x32 * np.float32(ALPHA)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 7, 4096 + 3, 1 << 20])
def test_scale_on_torch_current_stream(dtype, n):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    x = torch.randn(n, device="cuda").to(tdt)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        call = _arrays.Call({"x": x})
        assert call.stream.ptr == s.cuda_stream  # the caller's current stream, not the default one
        assert call["x"].data.ptr == x.data_ptr()  # zero copy in
        y = _common_ops.scale(x, ALPHA)
    s.synchronize()
    assert isinstance(y, torch.Tensor) and y.dtype == tdt and y.device == x.device
    ref = (x.float() * ALPHA).to(tdt)
    assert torch.equal(y, ref)


def test_scale_unaligned_view_uses_scalar_path():
    torch = pytest.importorskip("torch")
    x = torch.randn(1001, device="cuda", dtype=torch.bfloat16)[1:]  # 2-byte offset: not 16-B aligned
    y = _common_ops.scale(x, ALPHA)
    torch.cuda.synchronize()
    assert torch.equal(y, (x.float() * ALPHA).to(torch.bfloat16))


def test_scale_on_cupy_stream():
    import cupy

    x = cupy.random.standard_normal(12345).astype(cupy.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        y = _common_ops.scale(x, ALPHA)
        assert _arrays.Call({"x": x}).stream is s
    s.synchronize()
    assert isinstance(y, cupy.ndarray)
    np.testing.assert_array_equal(y.get(), _expected(x.get()))


def test_explicit_stream_argument():
    import cupy
    torch = pytest.importorskip("torch")

    x = cupy.arange(100, dtype=cupy.float32)
    ts = torch.cuda.Stream()
    y = _common_ops.scale(x, ALPHA, stream=ts)  # a torch stream given to a CuPy call
    ts.synchronize()
    np.testing.assert_array_equal(y.get(), _expected(x.get()))
    y2 = _common_ops.scale(x, ALPHA, stream=ts.cuda_stream)  # as an int
    ts.synchronize()
    np.testing.assert_array_equal(y2.get(), _expected(x.get()))


def test_bf16_torch_zero_copy_in_and_out():
    torch = pytest.importorskip("torch")
    x = torch.randn(64, 33, device="cuda", dtype=torch.bfloat16)
    call = _arrays.Call({"x": x})
    v = call["x"]
    assert v.data.ptr == x.data_ptr() and v.dtype == _arrays.BFLOAT16 and v.shape == (64, 33)
    with call:
        y = call.xp.empty_like(v)
        out = call.out(y)
    assert out.data_ptr() == y.data.ptr and out.dtype == torch.bfloat16


def test_bf16_jax_zero_copy_in_and_out():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = jnp.arange(4096, dtype=jnp.float32).astype(jnp.bfloat16).reshape(64, 64)
    x.block_until_ready()
    call = _arrays.Call({"x": x})
    assert call.framework == "jax"
    assert call["x"].data.ptr == x.unsafe_buffer_pointer()
    y = _common_ops.scale(x, ALPHA)
    assert isinstance(y, jax.Array) and y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)),
                                  np.asarray((x.astype(jnp.float32) * ALPHA).astype(jnp.bfloat16)
                                             .astype(jnp.float32)))
    with call:
        z = call.xp.zeros((8, 8), _arrays.BFLOAT16)
        zj = call.out(z)
    assert zj.unsafe_buffer_pointer() == z.data.ptr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_inside_jax_jit_on_xla_stream(dtype):
    jax = pytest.importorskip("jax")
    from jax.experimental.buffer_callback import buffer_callback

    jnp = jax.numpy
    seen_streams = []

    def cb(ctx, out, x):
        call = _arrays.Call({"x": x, "out": out}, stream=ctx.stream)
        seen_streams.append(call.stream.ptr)
        with call:
            _common_ops.scale_copy_into(call["x"], call["out"], ALPHA, call.stream)

    @jax.jit
    def f(x):
        y = buffer_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
        return y * 2  # consumed by XLA on its own stream

    x = jax.random.normal(jax.random.PRNGKey(0), (1000, 37), dtype=jnp.float32).astype(dtype)
    y = f(x)
    ref = ((x.astype(jnp.float32) * ALPHA).astype(dtype) * 2)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))
    assert seen_streams and all(s not in (0, 1, 2) for s in seen_streams)  # XLA's own stream


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
def test_torch_cuda_views_without_dlpack(dtype):
    """Torch CUDA tensors on torch's current stream are read by pointer, shape and strides: views of the same
    memory (offsets, transposes, zero-size) with the same values."""
    import torch

    base = (torch.randn(6, 10, device="cuda") * 4).to(getattr(torch, dtype))
    cases = [base, base[2:5, 3:], base.t(), base[:, ::2], base[:0]]
    for t in cases:
        with _arrays.Call({"t": t}) as call:
            v = call["t"]
            assert v.shape == tuple(t.shape)
            if t.numel():
                assert v.data.ptr == t.data_ptr()
                assert v.strides == tuple(s * t.element_size() for s in t.stride())
            got = _arrays.export(v.copy(), "torch")
            assert got.dtype == t.dtype and torch.equal(got.cpu(), t.cpu())


def test_driver_and_cupy_launchers_agree(monkeypatch):
    """Every op launches through the driver's cuLaunchKernel; CuPy's launcher (MOE_RT_LAUNCH=cupy) must give
    the same bits for the same calls."""
    import cupy as cp

    import moe_rt
    from moe_rt import _jit

    rng = np.random.default_rng(3)
    T, E, K, H = 257, 64, 8, 72
    logits = cp.asarray(rng.standard_normal((T, E), dtype=np.float32))
    x = cp.asarray(rng.standard_normal((T, H), dtype=np.float32))

    def run():
        probs, rmap, inter = moe_rt.topk_with_score(logits, K, score_function="sigmoid", num_groups=8,
                                                    group_topk=4, scaling_factor=2.0)
        idx, w = moe_rt.topk_indices_with_score(logits, K)
        plan = moe_rt.make_plan(idx, E, align_size=16)
        xp, pp = moe_rt.dispatch(x, plan, w)
        y = moe_rt.combine(xp, plan, w)
        return [a.copy() for a in (probs, rmap, inter, idx, w, xp, pp, y)]

    assert _jit._use_driver, "the driver launcher is not in use"
    fast = run()
    monkeypatch.setattr(_jit, "_use_driver", False)
    slow = run()
    for a, b in zip(fast, slow):
        assert cp.array_equal(a, b)


def test_launch_from_a_thread_new_to_cuda():
    """A kernel launched from a thread that has made no CUDA call yet (as torch's autograd workers are when
    they first run a moe_rt backward) binds the device's context first."""
    import threading

    torch = pytest.importorskip("torch")
    x = torch.randn(4099, device="cuda")
    out = {}

    def work():
        try:
            out["y"] = _common_ops.scale(x, ALPHA)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            out["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in out, out.get("error")
    assert torch.equal(out["y"], x * ALPHA)
