"""The ops' host set-up on this machine: the one-pass torch light call (``_arrays.Call._torch_light``) against
the full set-up, over the counting torch stand-ins of tools/profile_core_calls.py (CUDA tensors at made-up
addresses); and the per-signature checks of moe_rt.router, which must refuse what they refused uncached."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import moe_rt
from moe_rt import _arrays, router

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_torch(monkeypatch):
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("profile_core_calls", ROOT / "tools" / "profile_core_calls.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    Tensor, empty, raw, cur = tool.make_fake_torch()
    monkeypatch.setattr(_arrays, "_torch_raw_stream", lambda dev: 0x5000 + dev)
    monkeypatch.setattr(_arrays, "_torch_cur_device", lambda: 0)
    monkeypatch.setitem(_arrays._devices, 0, tool.FakeDevice(0))
    monkeypatch.setitem(_arrays._devices, 1, tool.FakeDevice(1))
    return torch, Tensor


def _full(monkeypatch, arrays):
    with monkeypatch.context() as m:
        m.setattr(_arrays.Call, "_torch_light", lambda self, arrays: False)
        return _arrays.Call(dict(arrays), lean=True)


def test_torch_light_call_matches_full_setup(fake_torch, monkeypatch):
    torch, Tensor = fake_torch
    arrays = {"x": Tensor((7, 33), torch.bfloat16), "probs": None, "idx": Tensor((7, 3), torch.int32)}
    fast = _arrays.Call(dict(arrays), lean=True)
    full = _full(monkeypatch, arrays)
    assert fast._light and full._light
    for attr in ("framework", "backend", "device_id", "stream_ptr", "_first", "_fast_torch", "_lean", "_current",
                 "_on_xla_stream", "_stream"):
        assert getattr(fast, attr) == getattr(full, attr), attr
    assert fast.stream_ptr == 0x5000
    assert list(fast.views) == list(full.views)
    assert fast["probs"] is None and full["probs"] is None
    for name in ("x", "idx"):
        a, b = fast[name], full[name]
        assert type(a) is type(b) is _arrays.DevArray
        assert (a.ptr, a.shape, a.dtype, a.owner, a.device_id, a.offset) == (b.ptr, b.shape, b.dtype, b.owner,
                                                                              b.device_id, b.offset)
        assert fast.out(a) is arrays[name] and full.out(b) is arrays[name]
    with fast:
        assert _arrays._light.call is fast
    assert getattr(_arrays._light, "call", None) is None


@pytest.mark.parametrize("setup", ["light", "full"])
def test_a_dropped_light_call_frees_its_arrays_at_once(fake_torch, monkeypatch, setup):
    """A light call (both set-ups) and its arrays are freed when the last reference goes, not when the cyclic
    collector next runs: an EP round trip's combine input (a 1.75 GiB recv_x at T=4096 on 4 ranks) kept by a
    cycle per call ran a GPU out of memory within some 40 calls."""
    import gc
    import weakref

    torch, Tensor = fake_torch
    x = Tensor((7, 33), torch.bfloat16)
    tensor = weakref.ref(x)
    gc.collect()
    gc.disable()
    try:
        call = _arrays.Call({"x": x}, lean=True) if setup == "light" else _full(monkeypatch, {"x": x})
        del x
        assert call._light
        with call:
            assert call.xp is not None and call.xp is not call.xp  # made at each read, never kept
        ref = weakref.ref(call)
        del call
        assert ref() is None and tensor() is None
    finally:
        gc.enable()


def test_torch_light_call_refuses_as_full_setup(fake_torch, monkeypatch):
    torch, Tensor = fake_torch
    other = Tensor((4, 8), torch.float32)
    other.get_device = lambda: 1
    arrays = {"x": Tensor((4, 8), torch.float32), "probs": other}
    with pytest.raises(ValueError) as fast:
        _arrays.Call(dict(arrays), lean=True)
    with pytest.raises(ValueError) as full:
        _full(monkeypatch, arrays)
    assert str(fast.value) == str(full.value) == ("probs is on cuda:1 but x is on cuda:0; all arrays of one call "
                                                  "must be on the same device")
    grad = Tensor((4, 8), torch.float32)
    grad.requires_grad = True
    with pytest.raises(TypeError, match="^probs: a torch tensor that requires grad"):
        _arrays.Call({"x": Tensor((4, 8), torch.float32), "probs": grad}, lean=True)


def test_torch_light_call_leaves_other_calls_to_full_setup(fake_torch, monkeypatch):
    """A strided tensor, a dtype outside moe_rt's, a tensor on a device that is not torch's current one: not
    the light call's (the full set-up handles them)."""
    torch, Tensor = fake_torch
    strided = Tensor((4, 8), torch.float32)
    strided.is_contiguous = lambda: False
    on1 = Tensor((4, 8), torch.float32)
    on1.get_device = lambda: 1
    for t in (strided, Tensor((4, 8), torch.complex64), on1):
        call = _arrays.Call.__new__(_arrays.Call)
        assert call._torch_light({"x": t}) is False
        assert not hasattr(call, "views")


@pytest.fixture
def fake_cupy(monkeypatch):
    """CuPy arrays of the counting stand-ins (made-up device addresses), CuPy's current stream and device
    stood in too."""
    pytest.importorskip("cupy")
    spec = importlib.util.spec_from_file_location("profile_core_calls", ROOT / "tools" / "profile_core_calls.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    ndarray, _ = tool.make_fake_cupy()
    streams = {d: tool.FakeStream(0x6000 + d) for d in (0, 1)}
    monkeypatch.setattr(_arrays, "_default_stream", lambda fw, dev: streams[dev])
    monkeypatch.setattr(_arrays, "_cupy_device", lambda: 0)
    monkeypatch.setitem(_arrays._devices, 0, tool.FakeDevice(0))
    monkeypatch.setitem(_arrays._devices, 1, tool.FakeDevice(1))
    return ndarray, tool.FakeDevice


def _full_cupy(monkeypatch, arrays, lean=True):
    with monkeypatch.context() as m:
        m.setattr(_arrays.Call, "_cupy_plain", lambda self, arrays, lean: False)
        return _arrays.Call(dict(arrays), lean=lean)


@pytest.mark.parametrize("lean", [True, False])
def test_cupy_call_matches_full_setup(fake_cupy, monkeypatch, lean):
    ndarray, _ = fake_cupy
    arrays = {"x": ndarray((7, 33), np.float32), "probs": None, "idx": ndarray((7, 3), np.int32)}
    fast = _arrays.Call(dict(arrays), lean=lean)
    full = _full_cupy(monkeypatch, arrays, lean)
    for attr in ("framework", "backend", "device_id", "stream_ptr", "_first", "_fast_torch", "_lean", "_current",
                 "_on_xla_stream", "_stream", "_light", "_device", "xp"):
        assert getattr(fast, attr) == getattr(full, attr), attr
    assert fast.stream_ptr == 0x6000 and fast._current
    assert list(fast.views) == list(full.views) == list(arrays)
    assert all(fast[k] is arrays[k] and full[k] is arrays[k] for k in arrays)
    with fast:
        assert fast.out(fast["x"]) is arrays["x"]


def test_cupy_call_refuses_as_full_setup(fake_cupy, monkeypatch):
    """Arrays on two devices, then a CuPy FP8 array: the same errors as the full set-up, in its order (the
    devices first, whichever array comes first)."""
    ndarray, FakeDevice = fake_cupy
    on1 = ndarray((4, 8), np.float32)
    type(on1).device = property(lambda self: FakeDevice(getattr(self, "_dev", 0)))
    on1._dev = 1
    fp8 = ndarray((4, 8), _arrays.FLOAT8_E4M3)
    for arrays, err, msg in [
            ({"x": ndarray((4, 8), np.float32), "probs": on1}, ValueError,
             "probs is on cuda:1 but x is on cuda:0; all arrays of one call must be on the same device"),
            ({"x": fp8, "probs": on1}, ValueError,
             "probs is on cuda:1 but x is on cuda:0; all arrays of one call must be on the same device"),
            ({"x": ndarray((4, 8), np.float32), "probs": fp8}, TypeError, "probs: a CuPy float8_e4m3fn array")]:
        with pytest.raises(err) as fast:
            _arrays.Call(dict(arrays), lean=True)
        with pytest.raises(err) as full:
            _full_cupy(monkeypatch, arrays)
        assert str(fast.value) == str(full.value) and str(fast.value).startswith(msg)


def test_cached_checks_refuse_as_uncached(rng):
    x = rng.standard_normal((5, 12)).astype(np.float32)
    assert router.check_topk_args(x, None, 1, "softmax", False, None, None, 0.0)[4] == 0.0
    with pytest.raises(TypeError, match="^topk: expected an int, got bool"):
        router.check_topk_args(x, None, True, "softmax", False, None, None, 0.0)
    with pytest.raises(TypeError, match="^use_pre_softmax: expected a bool, got int"):
        router.check_topk_args(x, None, 1, "softmax", 0, None, None, 0.0)
    neg = router.check_topk_args(x, None, 1, "softmax", False, None, None, -0.0)[4]
    assert neg == 0.0 and np.signbit(neg)
    with pytest.raises(TypeError, match="^score_function: expected a str"):
        router.check_topk_args(x, None, 1, ["softmax"], False, None, None, None)
    with pytest.raises(ValueError, match="^scaling_factor: must be finite"):
        router.check_topk_args(x, None, 1, "softmax", False, None, None, float("nan"))
    with pytest.raises(ValueError, match="^topk: must be <= num_experts"):
        router.check_topk_args(x[:, :1], None, 2, "softmax", False, None, None, None)
    with pytest.raises(TypeError, match="^logits: dtype must be one of"):
        router.check_topk_args(x.astype(np.int32), None, 1, "softmax", False, None, None, None)
    assert router.check_scores_args(x, 3, "sigmoid") == (12, 3)
    with pytest.raises(TypeError, match="^topk: expected an int, got float"):
        router.check_scores_args(x, 3.0, "sigmoid")
    tpe = np.ones(12, np.int32)
    assert router.check_aux_loss_args(x, tpe, 5, 12, 2, 0.5) == (5, 12, 0.5)
    with pytest.raises(TypeError, match="^total_num_tokens: expected an int"):
        router.check_aux_loss_args(x, tpe, np.bool_(True), 12, 2, 0.5)
    with pytest.raises(TypeError, match="^total_num_tokens: expected an int"):
        router.check_aux_loss_args(x, tpe, True, 12, 2, 0.5)


def test_cached_ops_match_reference_each_call(rng):
    """The same signature twice (its checks kept from the first call): the same results as the reference."""
    from moe_rt.reference import router as ref

    for _ in range(2):
        x = rng.standard_normal((6, 16)).astype(np.float32)
        p, m, y = moe_rt.topk_with_score(x, 4, score_function="sigmoid", scaling_factor=2.0)
        rp, rm, ry = ref.topk_with_score_fwd(x, 4, score_function="sigmoid", scaling_factor=2.0)
        np.testing.assert_array_equal(p, rp)
        np.testing.assert_array_equal(m, rm)
        g = rng.standard_normal((6, 16)).astype(np.float32)
        gl = moe_rt.topk_with_score_backward(g, m, y, 4, score_function="sigmoid", scaling_factor=2.0)
        np.testing.assert_array_equal(gl, ref.topk_with_score_bwd(g, m, y, 4, False, 2.0, "sigmoid"))


def test_cached_permutation_checks_refuse_as_uncached(rng):
    from moe_rt import permutation as perm

    assert perm.check_plan_settings(8, 1, None) == (8, 1, None)
    with pytest.raises(TypeError, match="^align_size: expected an int, got bool"):
        perm.check_plan_settings(8, True, None)
    with pytest.raises(ValueError, match="^map_type: expected None"):
        perm.check_plan_settings(8, 1, None, ["mask"])
    idx = np.zeros((5, 2), np.int32)
    assert perm.check_routing(idx, 8, 1, None) == (5, 2, False, 10)
    with pytest.raises(TypeError, match="^routing: expected topk_idx"):
        perm.check_routing(idx.astype(np.float32), 8, 1, None)
    with pytest.raises(ValueError, match="^num_out_tokens: must be <= T\\*K"):
        perm.check_routing(idx, 8, 1, 11)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    probs = np.ones((5, 2), np.float32)
    assert perm.check_dispatch_args(x, probs, 5, 2, 8) == np.float32
    with pytest.raises(ValueError, match="^x: expected 6 rows"):
        perm.check_dispatch_args(x, probs, 6, 2, 8)
    with pytest.raises(ValueError, match="^probs: expected shape"):
        perm.check_dispatch_args(x, probs[:, :1], 5, 2, 8)
    perm.check_combine_args(np.zeros((10, 6), np.float32), probs, 5, 2, 8, 10)
    with pytest.raises(TypeError, match="^y_permuted: dtype must be one of"):
        perm.check_combine_args(np.zeros((10, 6), np.int32), probs, 5, 2, 8, 10)


def test_cached_plan_ops_match_reference_each_call(rng):
    from moe_rt.reference import permutation as pref

    for _ in range(2):
        idx = np.stack([rng.permutation(7)[:3] for _ in range(9)]).astype(np.int32)
        plan = moe_rt.make_plan(idx, 7)
        x = rng.standard_normal((9, 5)).astype(np.float32)
        probs = rng.random((9, 3)).astype(np.float32)
        d = pref.make_plan(idx, 7, 1, None)
        xp, pp = moe_rt.dispatch(x, plan, probs)
        rxp, rpp = pref.dispatch(x, d, probs)
        np.testing.assert_array_equal(xp, rxp)
        np.testing.assert_array_equal(pp, rpp)
        np.testing.assert_array_equal(moe_rt.combine(xp, plan, probs), pref.combine(xp, d, probs))


def test_numpy_calls_import_neither_torch_nor_jax():
    """A caller of NumPy (or CuPy) arrays never pays for importing torch or JAX: the call set-up looks at
    torch's dtypes only once a torch tensor came (importing torch takes seconds, and a first call's time
    counts against the first-use targets)."""
    code = textwrap.dedent('''
        import sys
        import numpy as np
        import moe_rt
        rng = np.random.default_rng(3)
        x = rng.standard_normal((9, 16)).astype(np.float32)
        probs, rmap, inter = moe_rt.topk_with_score(x, 3)
        moe_rt.topk_with_score_backward(probs, rmap, inter, 3, score_function="softmax")
        scores, smap, sinter = moe_rt.scores_for_aux_loss(x, 3, "softmax")
        moe_rt.scores_for_aux_loss_backward(scores, sinter, 3, "softmax")
        plan = moe_rt.make_plan(rmap, 16)
        y, _ = moe_rt.dispatch(rng.standard_normal((9, 5)).astype(np.float32), plan)
        moe_rt.combine(y, plan, probs)
        moe_rt.dispatch_backward(y, plan)
        print(sorted(m for m in ("torch", "jax") if m in sys.modules))
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_no_op_leaves_reference_cycles(framework):
    """Every single-GPU op's CUDA path, run over the stand-ins of tools/profile_core_calls.py (the real facade
    and C core; the device and the framework's allocator stood in), leaves no object in a reference cycle: a
    call's arrays caught in one outlive the call until Python's cyclic collector runs."""
    pytest.importorskip("torch" if framework == "torch" else "cupy")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "profile_core_calls.py"), "--cycles", "--framework",
                        framework], capture_output=True, text=True, timeout=300, cwd=str(ROOT),
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ": " in ln]
    assert len(rows) >= 11, r.stdout  # every op of the tool's table reported
    leaks = [ln.split(":")[0] + ": " + ", ".join(p for p in ln.split(", ") if "cyclic " in p) for ln in rows
             if "cyclic " in ln]
    assert not leaks, "\n".join(leaks)
