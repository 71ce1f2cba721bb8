"""The DLPack boundary: consumer, producer and the Call that every op goes through (CPU arrays here;
CUDA arrays in test_smoke_gpu.py)."""
import numpy as np
import pytest

import ml_dtypes
from moe_rt import _arrays, _dlpack

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.float32, np.float16, BF16, np.int32, np.int64, np.uint8, np.bool_]


def _sample(dtype, shape=(3, 5), rng=None):
    rng = rng or np.random.default_rng(0)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) > 0.5
    return (rng.standard_normal(shape) * 10).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
def test_exported_numpy_round_trip(dtype, max_version, rng):
    a = _sample(dtype, rng=rng)
    ex = _dlpack.Exported.from_numpy(a)
    view = _dlpack.consume_capsule(ex.__dlpack__(max_version=max_version))
    assert view.versioned == (max_version is not None)
    assert view.dtype == np.dtype(dtype) and view.shape == a.shape and view.device_type == "cpu"
    b = _arrays.wrap(view)
    np.testing.assert_array_equal(b, a)
    assert b.ctypes.data == a.ctypes.data  # zero copy


def test_consume_numpy_and_writes_are_shared():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = _arrays.wrap(_dlpack.consume(a))
    b[1, 2] = -7.0
    assert a[1, 2] == -7.0


def test_non_contiguous_and_offset():
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    view = base[1:5:2, 3:9:2]  # byte offset, non-unit strides on both axes
    imp = _dlpack.consume(view)
    assert imp.strides == (20, 2) and not imp.is_c_contiguous
    np.testing.assert_array_equal(_arrays.wrap(imp), view)
    t = np.arange(20, dtype=np.int64).reshape(4, 5).T  # Fortran order
    np.testing.assert_array_equal(_arrays.wrap(_dlpack.consume(t)), t)


def test_zero_size_and_scalar():
    e = np.empty((0, 7), np.float16)
    assert _arrays.wrap(_dlpack.consume(e)).shape == (0, 7)
    s = np.float32(3.5).reshape(())
    w = _arrays.wrap(_dlpack.consume(np.asarray(s)))
    assert w.shape == () and w == 3.5


def test_bad_inputs():
    with pytest.raises(TypeError, match="__dlpack__"):
        _dlpack.consume([1, 2, 3])
    with pytest.raises(TypeError, match="complex"):
        _dlpack.consume(np.zeros(3, np.complex64))
    cap = np.zeros(3, np.float32).__dlpack__()
    _dlpack.consume_capsule(cap)
    with pytest.raises(TypeError, match="unused DLPack capsule"):
        _dlpack.consume_capsule(cap)  # already used
    with pytest.raises(TypeError, match="not supported"):
        _dlpack.dtype_from_dlpack(2, 32, 4)  # vector lanes
    with pytest.raises(BufferError):
        _dlpack.Exported.from_numpy(np.zeros(2, np.float32)).__dlpack__(copy=True)


def test_readonly_flag():
    a = np.arange(4, dtype=np.float32)
    a.flags.writeable = False
    view = _dlpack.consume_capsule(_dlpack.Exported.from_numpy(a).__dlpack__(max_version=(1, 0)))
    assert view.readonly
    w = _arrays.wrap(view)
    assert not w.flags.writeable


def test_exported_to_numpy_consumer():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = np.from_dlpack(_dlpack.Exported.from_numpy(a))
    np.testing.assert_array_equal(a, b)
    assert b.ctypes.data == a.ctypes.data


# ---- torch and JAX CPU tensors ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "int64", "uint8", "bool"])
def test_torch_cpu_round_trip(dtype, rng):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    src = torch.from_numpy(_sample(np.float32 if dtype != "bool" else np.bool_, (4, 6), rng))
    t = src.to(tdt)
    call = _arrays.Call({"x": t})
    v = call["x"]
    assert call.backend == "cpu" and call.framework == "torch"
    assert np.dtype(v.dtype) == (BF16 if dtype == "bfloat16" else np.dtype(dtype))
    assert v.ctypes.data == t.data_ptr()  # zero copy in
    back = call.out(v)
    assert isinstance(back, torch.Tensor) and back.dtype == tdt
    assert back.data_ptr() == t.data_ptr()  # zero copy out
    assert torch.equal(back, t)


def test_torch_non_contiguous_and_offset():
    torch = pytest.importorskip("torch")
    t = torch.arange(100, dtype=torch.bfloat16).reshape(10, 10)[2:7:2, 1:9:3]
    v = _arrays.Call({"x": t})["x"]
    np.testing.assert_array_equal(v.astype(np.float32), t.float().numpy())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "bool"])
def test_jax_cpu_round_trip(dtype):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = jnp.arange(12).reshape(3, 4).astype(getattr(jnp, "bool_" if dtype == "bool" else dtype))
    x = jax.device_put(x, jax.devices("cpu")[0])  # JAX's default device may be a GPU
    call = _arrays.Call({"x": x})
    v = call["x"]
    assert call.framework == "jax"
    np.testing.assert_array_equal(np.asarray(v), np.asarray(x))
    back = call.out(v.copy())
    assert isinstance(back, jax.Array) and back.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_call_rejects_non_arrays_and_empty():
    with pytest.raises(TypeError, match="x: expected an array"):
        _arrays.Call({"x": "not an array"})
    # every array None: the first (the op's leading, required array) is named
    with pytest.raises(TypeError, match="x: expected an array .*got NoneType"):
        _arrays.Call({"x": None})
    with pytest.raises(TypeError, match="no array argument was given"):
        _arrays.Call({})


def test_call_framework_follows_first_array():
    torch = pytest.importorskip("torch")
    call = _arrays.Call({"a": np.zeros(2, np.float32), "b": torch.zeros(2)})
    assert call.framework == "numpy" and isinstance(call["b"], np.ndarray)


def test_validation_helpers():
    a = np.zeros((2, 3), np.float64)
    with pytest.raises(TypeError, match="x: dtype must be one of float32, float16, bfloat16, got float64"):
        _arrays.check_dtype(a, "x", _arrays.FLOAT_DTYPES)
    with pytest.raises(ValueError, match="x: expected a 3-D array"):
        _arrays.check_ndim(a, "x", 3)
    with pytest.raises(TypeError, match="k: expected an int"):
        _arrays.check_int(2.0, "k")
    with pytest.raises(ValueError, match="k: must be >= 1"):
        _arrays.check_int(0, "k", low=1)
