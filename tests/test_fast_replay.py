"""Recorded launches (moe_rt._fast): a replay must make exactly the launches the op's ordinary path makes
for the same arrays, and hand back the same results.

CPU tests run the ops' CUDA paths against a fake device: kernels are named stand-ins, the driver's launcher
writes down what it is asked to launch, and the arrays are DevArrays at made-up addresses served as a JAX
callback serves XLA's buffers. GPU tests compare the bits of replayed and ordinary calls on torch tensors.
"""
import math

import numpy as np
import pytest

# The fake device stands in for the driver, but the ops' CUDA paths still take CuPy's streams and devices.
pytest.importorskip("cupy", reason="the CUDA paths under test need CuPy (moe_rt installed without a CUDA extra)")

import moe_rt.permutation as P  # noqa: E402
import moe_rt.router as R  # noqa: E402
from moe_rt import _arrays, _errors, _fast, _jit  # noqa: E402
from moe_rt._arrays import DevArray  # noqa: E402

F32, BF16 = np.dtype(np.float32), _arrays.BFLOAT16


class _Fn:
    def __init__(self, name):
        self.name = name
        self.ptr = 0x1000 + (hash(name) & 0xFFFFF) * 16
        self.num_regs = 40
        self.max_dynamic_shared_size_bytes = 0
        self.kernel = self


class _Driver:
    def __init__(self):
        self.calls = []

    def launch(self, fptr, grid, block, args, stream, smem):
        self.calls.append((fptr, grid, block, tuple(a.ptr if type(a) is DevArray else a for a in args), stream,
                           smem))
        return True


class _PackedDriver:
    """The driver launcher itself (``moe_rt._launch``: recorded launches packed once by ``Launches``) over its
    stand-in for cuLaunchKernel; ``calls`` in the form of :class:`_Driver`'s, each argument as the 64-bit slot
    the kernel would get."""

    def __init__(self, launch_mod):
        self._m = launch_mod
        self.Launches = launch_mod.Launches
        self._calls = []

    def launch(self, fptr, grid, block, args, stream, smem):
        return self._m.launch(fptr, grid, block, args, stream, smem)

    @property
    def calls(self):
        for fptr, grid, block, smem, stream, packed in self._m._fake_driver(True):
            self._calls.append((fptr, grid, block, tuple(np.frombuffer(packed, np.uint64).tolist()), stream, smem))
        return self._calls


class _Ctx:
    def __init__(self, ptr=0):
        self.ptr = ptr

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


STREAM = 0xABC0
ERR_WORD = 0x7E0000000100  # the fake device's error word (moe_rt._errors)


@pytest.fixture(params=["python", "packed"])
def fake_device(monkeypatch, request):
    """The fake device, its launches written down by a Python stand-in for the driver launcher ("python") or
    by the driver launcher itself over a stand-in for cuLaunchKernel ("packed": recorded launches go through
    ``_launch.Launches``)."""
    if request.param == "packed":
        from moe_rt import _launch

        drv = _PackedDriver(_launch)
        _launch._fake_driver(True)
        request.addfinalizer(lambda: _launch._fake_driver(False))
        monkeypatch.setattr(_jit, "_real_driver", drv)
    else:
        drv = _Driver()
    fns = {}
    monkeypatch.setattr(_jit, "function", lambda file, name: fns.setdefault((file, name), _Fn(name)))
    monkeypatch.setattr(_jit, "function_tiered", lambda file, name, quick: (_jit.function(file, name), True))
    monkeypatch.setattr(_jit, "device_properties",
                        lambda dev: {"name": "fake", "sm_count": 132, "smem_per_block_optin": 227 * 1024,
                                     "smem_per_sm": 228 * 1024, "l2_bytes": 50 << 20, "cc": (9, 0),
                                     "total_memory": 80 << 30})
    monkeypatch.setattr(_jit, "_driver", drv)
    monkeypatch.setattr(_jit, "_use_driver", True)
    monkeypatch.setattr(_jit, "_ptrs", {})
    monkeypatch.setattr(P, "_fns", {})
    monkeypatch.setattr(P, "_plan_cfgs", {})
    monkeypatch.setattr(_errors, "_words", {0: ERR_WORD})
    monkeypatch.setattr(_arrays, "_default_stream", lambda fw, dev: _Ctx(STREAM))
    monkeypatch.setitem(_arrays._devices, 0, _Ctx())
    monkeypatch.setattr(_fast, "ENABLED", True)
    return drv


class _Mem:
    """Made-up device memory: each array at its own 256-byte aligned address."""

    def __init__(self):
        self.next = 0x7F0000000000

    def __call__(self, shape, dtype, misalign=0):
        dtype = np.dtype(dtype)
        ptr = self.next + misalign
        self.next += (math.prod(shape) * dtype.itemsize + 4096) // 256 * 256
        return DevArray(ptr, tuple(shape), dtype, object(), 0)


def _run_both(drv, op, args, kwargs, outs):
    """(launches, results) of the ordinary path and of the fast path (twice: the recording call and a
    replay), each over fresh serving lists of the same output buffers."""
    got = []
    for fn in (op.ordinary, op, op):
        drv.calls.clear()
        with _arrays.serving(list(outs), STREAM):
            res = fn(*args, **kwargs)
        got.append((list(drv.calls), res))
    return got


def _flat(res):
    if isinstance(res, (tuple, list)):
        return [x for r in res for x in _flat(r)]
    return [None if res is None else (res.ptr, res.shape, res.dtype)]


def _check(drv, op, args, kwargs, outs, recorded=True):
    (ord_calls, ord_res), (first_calls, first_res), (rep_calls, rep_res) = _run_both(drv, op, args, kwargs, outs)
    assert ord_calls, "the ordinary path launched nothing"
    assert first_calls == ord_calls
    assert rep_calls == ord_calls
    assert _flat(rep_res) == _flat(ord_res) == _flat(first_res)
    recipes = [r for r in op.recipes.values()]
    assert recipes and (recipes[-1] is not _fast._SLOW) == recorded


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("E,K,kw", [
    (64, 8, {}),
    (256, 8, dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5)),
    (2304, 36, dict(score_function="sqrtsoftplus")),
    (130, 2, dict(use_pre_softmax=True)),
])
def test_router_replay_matches_ordinary_launches(fake_device, dtype, E, K, kw):
    mem = _Mem()
    T = 77
    x = mem((T, E), dtype)
    outs = [mem((T, E), dtype), mem((T, E), np.bool_), mem((T, E), F32)]
    _check(fake_device, R.topk_with_score, (x, K), kw, outs)
    outs = [mem((T, K), np.int32), mem((T, K), F32)]
    _check(fake_device, R.topk_indices_with_score, (x, K), kw, outs)
    score = kw.get("score_function", "softmax")
    g, m, i = mem((T, E), dtype), mem((T, E), np.bool_), mem((T, E), F32)
    _check(fake_device, R.topk_with_score_backward, (g, m, i, K),
           dict(score_function=score, use_pre_softmax=kw.get("use_pre_softmax", False),
                scaling_factor=kw.get("scaling_factor")), [mem((T, E), dtype)])
    _check(fake_device, R.scores_for_aux_loss, (x, K, score), {},
           [mem((T, E), F32), mem((T, E), np.bool_), mem((T, E), F32)])
    _check(fake_device, R.scores_for_aux_loss_backward, (mem((T, E), F32), mem((T, E), F32), K, score),
           dict(dtype=dtype), [mem((T, E), dtype)])


@pytest.mark.parametrize("tdtype", [np.int32, np.int64, F32])
def test_aux_loss_replay_matches_ordinary_launches(fake_device, tdtype, monkeypatch):
    import cupy

    mem = _Mem()
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=F32, **kw: mem(tuple(shape), dtype))  # scratch
    R_, E = 3000, 64
    p = mem((R_, E), BF16)
    tpe = mem((E,), tdtype)
    # aux_loss: a scratch array (its address differs from call to call) and the 0-d result
    drv = fake_device
    outs = [mem((), BF16)]
    (oc, ores), (fc, fres), (rc, rres) = _run_both(drv, R.aux_loss, (p, tpe, 4096, E, 8, 1e-2), {}, outs)
    assert len(oc) == len(rc) == 2
    for a, b in zip(oc, rc):
        assert a[:3] == b[:3] and a[4:] == b[4:]
    # the partial sums: written by the first launch, read by the second, at the same address in one call
    assert rc[0][3][6] == rc[1][3][0] and oc[0][3][6] == oc[1][3][0]
    same = [j for j in range(len(oc[0][3])) if j != 6]
    assert [oc[0][3][j] for j in same] == [rc[0][3][j] for j in same]
    assert _flat(rres) == _flat(ores)
    _check(drv, R.aux_loss_backward, (mem((), F32), R_, tpe, 4096, E, 8, 1e-2), {}, [mem((R_, E), F32)])


def test_replay_keeps_misalignment_and_bias(fake_device):
    mem = _Mem()
    T, E, K = 33, 256, 8
    x = mem((T, E), F32, misalign=4)  # not 16-byte aligned: the scalar kernel path
    bias = mem((E,), F32)
    outs = [mem((T, E), F32), mem((T, E), np.bool_), mem((T, E), F32)]
    kw = dict(score_function="sigmoid", expert_bias=bias)
    _check(fake_device, R.topk_with_score, (x, K), kw, outs)
    # a bias that needs a conversion cannot be recorded: the ordinary path runs every time
    R.topk_with_score.recipes.clear()
    b16 = mem((E,), BF16)
    with _arrays.serving(list(outs), STREAM):
        with pytest.raises(Exception):  # noqa: B017 - the ordinary path's conversion needs a real device
            R.topk_with_score(x, K, score_function="sigmoid", expert_bias=b16)
    assert list(R.topk_with_score.recipes.values()) == [_fast._SLOW]


def test_bad_input_still_raises_through_the_fast_path(fake_device):
    mem = _Mem()
    x = mem((5, 16), F32)
    outs = [mem((5, 16), F32), mem((5, 16), np.bool_), mem((5, 16), F32)]
    for _ in range(2):  # the signature is remembered as one for the ordinary path, which raises each time
        with _arrays.serving(list(outs), STREAM):
            with pytest.raises(ValueError, match="topk"):
                R.topk_with_score(x, 17)
            with pytest.raises(TypeError, match="topk"):
                R.topk_with_score(x, True)
            with pytest.raises(ValueError, match="scaling_factor"):
                R.topk_with_score(x, 2, scaling_factor=float("inf"))
    # 2 and 2.0 are different signatures: the float is refused, not replayed from the int's recipe
    with _arrays.serving(list(outs), STREAM):
        R.topk_with_score(x, 2)
    with _arrays.serving(list(outs), STREAM):
        with pytest.raises(TypeError, match="topk"):
            R.topk_with_score(x, 2.0)


def _fake_plan(mem, T, K, E, N, misalign=0):
    arrays = [mem((T, K), np.int32, misalign), mem((N,), np.int32), mem((E + 1,), np.int32), mem((E,), np.int32),
              mem((E,), np.int32)]
    return P.Plan._trusted(arrays, num_rows=N, align_size=1, num_out_tokens=None, backend="cuda", device_id=0,
                           framework="devarray")


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("H", [1024, 72, 13])
def test_permutation_replay_matches_ordinary_launches(fake_device, dtype, H):
    mem = _Mem()
    T, K, E = 129, 8, 64
    N = T * K
    plan = _fake_plan(mem, T, K, E, N)
    x, w = mem((T, H), dtype), mem((T, K), F32)
    _check(fake_device, P.dispatch, (x, plan), {}, [mem((N, H), dtype)])
    _check(fake_device, P.dispatch, (x, plan, w), {}, [mem((N, H), dtype), mem((N,), F32)])
    yp = mem((N, H), dtype)
    _check(fake_device, P.combine, (yp, plan), {}, [mem((T, H), dtype)])
    _check(fake_device, P.combine, (yp, plan), dict(probs=w), [mem((T, H), dtype)])
    _check(fake_device, P.dispatch_backward, (yp, plan, mem((N,), F32)), {}, [mem((T, H), dtype), mem((T, K), F32)])
    gy = mem((T, H), dtype)
    _check(fake_device, P.combine_backward, (gy, plan), {}, [mem((N, H), dtype)])
    _check(fake_device, P.combine_backward, (gy, plan, yp, w), {}, [mem((N, H), dtype), mem((T, K), F32)])
    # another plan of the same shapes replays the same recipe with its own pointers
    plan2 = _fake_plan(mem, T, K, E, N)
    n = len(P.combine.recipes)
    _check(fake_device, P.combine, (yp, plan2), {}, [mem((T, H), dtype)])
    assert len(P.combine.recipes) == n


@pytest.mark.parametrize("routing", ["index", "map"])
def test_make_plan_replay_matches_ordinary_launches(fake_device, routing, monkeypatch):
    import cupy

    mem = _Mem()
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=F32, **kw: mem(tuple(shape), dtype))  # scratch
    T, K, E = 300, 8, 64
    r = mem((T, K), np.int32) if routing == "index" else mem((T, E), np.bool_)
    Kp = K if routing == "index" else E
    N = T * K
    outs = [mem((T, Kp), np.int32), mem((N,), np.int32), mem((E + 1,), np.int32), mem((E,), np.int32),
            mem((E,), np.int32)]
    got = []
    for fn in (P.make_plan.ordinary, P.make_plan, P.make_plan):
        fake_device.calls.clear()
        with _arrays.serving(list(outs), STREAM):
            plan = fn(r, E, num_out_tokens=N)
        got.append((list(fake_device.calls), plan))
    (oc, op_), (fc, fp), (rc, rp) = got
    assert len(oc) == 3
    # plan_count gets the device's error word: a constant address the replay passes unchanged
    assert oc[0][3][-1] == fc[0][3][-1] == rc[0][3][-1] == ERR_WORD
    for a, b in zip(oc, rc):  # the scratch (not an output) is the one argument allowed to move
        assert a[:3] == b[:3] and a[4:] == b[4:]
        assert [x for x in a[3] if x >= 0x7F0000000000 and any(x == o.ptr for o in outs)] == \
               [x for x in b[3] if x >= 0x7F0000000000 and any(x == o.ptr for o in outs)]
    for p in (fp, rp):
        assert type(p) is P.Plan and repr(p) == repr(op_)
        assert [p._v[k].ptr for k in P._PLAN_NAMES] == [o.ptr for o in outs]
        assert p._v["dst_row"].shape == (T, Kp)


@pytest.mark.parametrize("how", ["validate", "debug", "off"])
def test_make_plan_eager_check_runs_the_ordinary_path(fake_device, how, monkeypatch):
    """validate=True (or the debug switch) syncs after each call, so such calls are never replayed; with the
    check off the same signature replays and nothing syncs."""
    import cupy

    mem = _Mem()
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=F32, **kw: mem(tuple(shape), dtype))  # scratch
    syncs = []
    monkeypatch.setattr(_errors, "sync_and_raise", lambda dev, stream: syncs.append((dev, stream)))
    monkeypatch.setattr(_errors, "DEBUG", how == "debug")
    T, K, E = 50, 4, 16
    r = mem((T, K), np.int32)
    outs = [mem((T, K), np.int32), mem((T * K,), np.int32), mem((E + 1,), np.int32), mem((E,), np.int32),
            mem((E,), np.int32)]
    kw = {"validate": True} if how == "validate" else {}
    P.make_plan.recipes.clear()
    for _ in range(3):
        fake_device.calls.clear()
        with _arrays.serving(list(outs), STREAM):
            P.make_plan(r, E, **kw)
        assert len(fake_device.calls) == 3
        assert fake_device.calls[0][3][-1] == ERR_WORD
    recipes = list(P.make_plan.recipes.values())
    if how == "off":
        assert not syncs and recipes and recipes[-1] is not _fast._SLOW
    else:
        assert len(syncs) == 3 and syncs[0][0] == 0
        assert recipes == [_fast._SLOW]


def test_no_replay_outside_a_callback_or_when_disabled(fake_device, monkeypatch):
    mem = _Mem()
    x = mem((5, 16), F32)
    outs = [mem((5, 16), F32), mem((5, 16), np.bool_), mem((5, 16), F32)]
    with _arrays.serving(list(outs), STREAM):
        R.topk_with_score(x, 2)
    n = len(R.topk_with_score.recipes)
    monkeypatch.setattr(_fast, "ENABLED", False)
    with _arrays.serving(list(outs), STREAM):
        R.topk_with_score(x, 3)
    assert len(R.topk_with_score.recipes) == n


# -- the compiled torch replay (moe_rt._replay) against the Python one, on stand-in torch tensors --------

class _FakeTensor:
    """What the torch replay reads of a torch CUDA tensor, at a made-up address."""

    is_cuda = True

    def __init__(self, ptr, shape, dtype, device=0, contiguous=True, requires_grad=False):
        import torch

        self.ptr, self.shape, self.dtype = ptr, torch.Size(shape), dtype
        self.device, self.contiguous, self.requires_grad = device, contiguous, requires_grad

    def data_ptr(self):
        return self.ptr

    def get_device(self):
        return self.device

    def is_contiguous(self):
        return self.contiguous

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if shape == (-1,):
            shape = (math.prod(self.shape),)
        return _FakeTensor(self.ptr, shape, self.dtype, self.device)

    def __getitem__(self, sl):
        start = sl.start or 0
        return _FakeTensor(self.ptr + start * self.dtype.itemsize, (sl.stop - start,), self.dtype, self.device)


class _FakeTorch:
    """torch.empty and torch.device for the replay: outputs at made-up addresses, from ``base`` on."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.next = 0x6E0000000000
        self.grad_mode = True

    def is_grad_enabled(self):
        return self.grad_mode

    def empty(self, shape, dtype=None, device=None):
        t = _FakeTensor(self.next, shape, dtype, device[1])
        self.next += (math.prod(shape) * dtype.itemsize + 4096) // 256 * 256
        return t

    @staticmethod
    def device(kind, index):
        return (kind, index)


@pytest.fixture
def fake_torch(fake_device, monkeypatch):
    torch = pytest.importorskip("torch")
    ft = _FakeTorch()
    monkeypatch.setattr(_fast, "_Tensor", _FakeTensor)
    monkeypatch.setattr(_fast, "_torch", ft)
    monkeypatch.setattr(_fast, "_raw_stream", lambda dev: STREAM + 16 * dev)
    monkeypatch.setattr(_fast, "_cur_device", lambda: 0)
    monkeypatch.setattr(_fast, "_tdevs", {})
    return fake_device, ft, torch


def _tflat(res):
    if isinstance(res, (tuple, list)):
        return [type(res)] + [x for r in res for x in _tflat(r)]
    return [None if res is None else (res.ptr, tuple(res.shape), res.dtype)]


def test_compiled_torch_replay_matches_the_python_one(fake_torch, monkeypatch):
    """For torch tensors the compiled replay (``_replay.TorchHit``) makes the launches and returns the
    results of the Python replay, for recipes either one finds in the shared cache."""
    from moe_rt import _replay

    drv, ft, torch = fake_torch
    mem = _Mem()
    T, K, E, H = 77, 8, 64, 72
    N = T * K

    def tensor(shape, dtype, misalign=0):
        return _FakeTensor(mem(shape, np.uint8 if dtype == torch.bool else np.float32, misalign).ptr, shape, dtype)

    plan = _fake_plan(mem, T, K, E, N)
    logits, bias = tensor((T, E), torch.float32), tensor((E,), torch.float32)
    x, w = tensor((T, H), torch.bfloat16), tensor((T, K), torch.float32)
    yp, gy = tensor((N, H), torch.bfloat16), tensor((T, H), torch.bfloat16)
    tpe = tensor((E,), torch.int32)
    cases = [
        (R.topk_with_score, (logits, K), {}),
        (R.topk_with_score, (logits, K), dict(score_function="sigmoid", expert_bias=bias, scaling_factor=2.5)),
        (R.topk_with_score, (tensor((T, E), torch.float32, misalign=4), K), {}),
        (R.scores_for_aux_loss, (logits, K, "softmax"), {}),
        (R.aux_loss, (logits, tpe, 4096, E, K, 1e-2), {}),
        (P.dispatch, (x, plan), {}),
        (P.dispatch, (x, plan, w), {}),
        (P.dispatch, (x,), dict(plan=plan, probs=w)),
        (P.combine, (yp, plan), dict(probs=w)),
        (P.dispatch_backward, (yp, plan, tensor((N,), torch.float32)), {}),
        (P.combine_backward, (gy, plan, yp, w), {}),
    ]
    python_replay = _fast._replay_torch
    for op, args, kwargs in cases:
        got = {}
        for native in (False, True, False, True):  # the first call records (Python path)
            monkeypatch.setattr(_fast, "NATIVE", native)
            # the compiled path must not fall back to the Python replay
            monkeypatch.setattr(_fast, "_replay_torch", python_replay if not native else None)
            ft.reset()
            drv.calls.clear()
            res = op(*args, **kwargs)
            got.setdefault(native, []).append((list(drv.calls), _tflat(res)))
        assert got[True][0] == got[True][1] == got[False][1] == got[False][0], op.__name__
        assert got[True][0][0], "nothing launched"
        assert op.torch_hit(args, kwargs) is not _replay.MISS


def test_compiled_torch_replay_leaves_other_calls_to_the_python_path(fake_torch, monkeypatch):
    """``TorchHit`` serves recorded signatures of torch tensors on the current device alone: anything else
    is MISS (the Python path then decides), and so is every call with replays or the compiled path off."""
    from moe_rt import _replay

    drv, ft, torch = fake_torch
    mem = _Mem()
    T, K, E = 33, 4, 16
    logits = _FakeTensor(mem((T, E), F32).ptr, (T, E), torch.float32)
    hit = R.topk_with_score.torch_hit
    R.topk_with_score.recipes.clear()
    assert hit((logits, K), {}) is _replay.MISS  # not recorded yet
    R.topk_with_score(logits, K)  # records (Python path)
    assert hit((logits, K), {}) is not _replay.MISS
    MISS = _replay.MISS
    assert hit((logits, K + 1), {}) is MISS  # another signature
    assert hit((logits, K), dict(score_function="sigmoid")) is MISS
    assert hit((logits, K), dict(stream=object())) is MISS
    assert hit((_FakeTensor(logits.ptr, (T, E), torch.float32, contiguous=False), K), {}) is MISS
    assert hit((_FakeTensor(logits.ptr, (T, E), torch.float32, device=1), K), {}) is MISS
    assert hit((mem((T, E), F32), K), {}) is MISS  # not a torch tensor
    bias = _FakeTensor(mem((E,), F32).ptr, (E,), torch.float32, device=1)
    assert hit((logits, K), dict(expert_bias=bias)) is MISS  # arrays on two devices
    assert hit((logits, [K]), {}) is MISS  # an unhashable argument
    needs_grad = _FakeTensor(logits.ptr, (T, E), torch.float32, requires_grad=True)
    assert hit((needs_grad, K), {}) is MISS  # the ordinary path refuses it (no autograd in the core ops)
    ft.grad_mode = False
    assert hit((needs_grad, K), {}) is not MISS  # under no_grad it is served
    ft.grad_mode = True
    monkeypatch.setattr(_fast, "_cur_device", lambda: 1)
    assert hit((logits, K), {}) is MISS  # another current device
    monkeypatch.setattr(_fast, "_cur_device", lambda: 0)
    for name in ("NATIVE", "ENABLED"):
        monkeypatch.setattr(_fast, name, False)
        assert hit((logits, K), {}) is MISS
        monkeypatch.setattr(_fast, name, True)
    assert hit((logits, K), {}) is not MISS


# -- GPU: torch tensors, replayed against the ordinary path, bitwise -------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_torch_replay_bitwise(dtype, rng):
    torch = pytest.importorskip("torch")
    T, E, K = 1031, 256, 8
    dt = getattr(torch, dtype)
    x = torch.tensor(rng.permutation(T * E).reshape(T, E) / (T * E), dtype=torch.float32, device="cuda").to(dt)
    bias = torch.tensor(rng.standard_normal(E) * 0.1, dtype=torch.float32, device="cuda")
    g = torch.tensor(rng.standard_normal((T, E)), dtype=dt, device="cuda")
    kw = dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5, expert_bias=bias)

    def calls(fns):
        tk, tkb, sc, scb, aux, auxb = fns
        probs, rmap, inter = tk(x, K, **kw)
        gl = tkb(g, rmap, inter, K, score_function="sigmoid", scaling_factor=2.5)
        s, smap, sint = sc(x, K, "softmax")
        gs = scb(s * 0.5, sint, K, "softmax", dtype=x.dtype)
        tpe = smap.sum(0, dtype=torch.int32)
        loss = aux(s, tpe, T, E, K, 1e-2)
        gp = auxb(torch.ones((), device="cuda"), T, tpe, T, E, K, 1e-2)
        return [probs, rmap, inter, gl, s, smap, sint, gs, loss, gp]

    ops = [R.topk_with_score, R.topk_with_score_backward, R.scores_for_aux_loss, R.scores_for_aux_loss_backward,
           R.aux_loss, R.aux_loss_backward]
    want = calls([f.ordinary for f in ops])
    for _ in range(3):  # record, then replay twice
        got = calls(ops)
        for a, b in zip(got, want):
            assert type(a) is torch.Tensor and a.shape == b.shape and a.dtype == b.dtype
            assert torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                               b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8))
    for f in ops:
        assert any(v is not _fast._SLOW for v in f.recipes.values()), f.__name__


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["torch", "cupy"])
@pytest.mark.parametrize("routing", ["index", "map"])
def test_gpu_permutation_replay_bitwise(framework, routing, rng):
    import cupy as cp

    import moe_rt

    T, K, E, H = 517, 8, 64, 136
    scores = rng.random((T, E))
    idx = np.argsort(-scores, axis=1)[:, :K].astype(np.int32)
    rmap = np.zeros((T, E), bool)
    np.put_along_axis(rmap, idx, True, axis=1)
    host = dict(r=idx if routing == "index" else rmap, x=rng.standard_normal((T, H)).astype(np.float32),
                w=rng.random((T, K if routing == "index" else E)).astype(np.float32),
                gy=rng.standard_normal((T, H)).astype(np.float32))
    if framework == "torch":
        torch = pytest.importorskip("torch")
        a = {k: torch.from_numpy(v).cuda() for k, v in host.items()}
        a["x"], a["gy"] = a["x"].bfloat16(), a["gy"].bfloat16()
        raw = lambda t: t.contiguous().view(torch.uint8).cpu().numpy()  # noqa: E731
    else:
        a = {k: cp.asarray(v) for k, v in host.items()}
        a["x"], a["gy"] = a["x"].astype(_arrays.BFLOAT16), a["gy"].astype(_arrays.BFLOAT16)
        raw = lambda t: cp.ascontiguousarray(t).view(cp.uint8).get()  # noqa: E731

    def run(mp, disp, comb, dbwd, cbwd):
        plan = mp(a["r"], E, align_size=8, num_out_tokens=T * K - 5)
        xp, pp = disp(a["x"], plan, a["w"])
        y = comb(xp, plan, a["w"])
        gx, gpp = dbwd(xp, plan, pp)
        gyp, gw = cbwd(a["gy"], plan, xp, a["w"])
        arrays = [getattr(plan, k) for k in P._PLAN_NAMES] + [xp, pp, y, gx, gpp, gyp, gw]
        return [raw(t) for t in arrays]

    ops = [moe_rt.make_plan, moe_rt.dispatch, moe_rt.combine, moe_rt.dispatch_backward, moe_rt.combine_backward]
    want = run(*[f.ordinary for f in ops])
    for _ in range(3):
        got = run(*ops)
        for g, w in zip(got, want):
            assert g.tobytes() == w.tobytes()
    for f in ops:
        assert any(v is not _fast._SLOW for v in f.recipes.values()), f.__name__


@pytest.mark.gpu
def test_gpu_torch_make_plan_replay_gives_views_of_one_buffer(rng):
    # moe_rt.torch.make_plan over a replayed plan: five views of the replay's own torch buffer (no copy, no
    # round trip through CuPy), equal to the reference on every call.
    torch = pytest.importorskip("torch")
    import moe_rt.torch as mt

    T, K, E = 517, 8, 64
    idx = np.argsort(-rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
    ref = P.make_plan(idx, E, align_size=8)
    dev_idx = torch.from_numpy(idx).cuda()
    for _ in range(4):  # record, then replays
        tp = mt.make_plan(dev_idx, E, align_size=8)
        base = tp.dst_row.untyped_storage().data_ptr()
        for k in mt._PLAN_ARRAYS:
            t = getattr(tp, k)
            assert t.is_cuda and t.untyped_storage().data_ptr() == base, k
            np.testing.assert_array_equal(t.cpu().numpy(), getattr(ref, k), err_msg=k)
    assert any(v is not _fast._SLOW for v in P.make_plan.recipes.values())


def test_a_call_running_a_quick_kernel_is_not_recorded(fake_device, monkeypatch):
    """While a quick kernel stands in for the router kernel (its compile still running in the background), calls
    run the ordinary way and nothing is recorded; the first call after the kernel is ready is recorded, and
    its replays launch that kernel, not the quick one."""
    ready = {"main": False}

    def tiered(file, name, quick):
        if quick is not None and not ready["main"]:
            return _jit.function(file, quick), False
        return _jit.function(file, name), True

    monkeypatch.setattr(_jit, "function_tiered", tiered)
    monkeypatch.setattr(R, "_fwd_cfgs", {})
    mem = _Mem()
    T, E, K = 83, 64, 8
    x = mem((T, E), F32)
    outs = [mem((T, E), F32), mem((T, E), np.bool_), mem((T, E), F32)]
    op = R.topk_with_score
    quick = _jit.function("router.cu", "router_fwd_reg<float, 8, false, false, false, 0>").ptr
    main = _jit.function("router.cu", "router_fwd_reg<float, 8>").ptr

    def call():
        fake_device.calls.clear()
        with _arrays.serving(list(outs), STREAM):
            op(x, K)
        return [c[0] for c in fake_device.calls]

    op.recipes.clear()  # this signature may be recorded by the other fake driver's run
    before = dict(op.recipes)
    assert call() == [quick] and call() == [quick]
    assert op.recipes == before  # not recorded, and not remembered as unrecordable either
    ready["main"] = True
    assert call() == [main]
    new = [r for k, r in op.recipes.items() if k not in before]
    assert len(new) == 1 and new[0] is not _fast._SLOW
    assert call() == [main]  # the replay


# -- FP8 on the CUDA paths: CuPy never holds an FP8 dtype ------------------------------------------------
# CuPy (14.x) refuses to make or view arrays of ml_dtypes' float8 dtypes ("Unsupported dtype"); moe_rt keeps
# FP8 device arrays as DevArrays of the FP8 dtype over memory CuPy sees as uint8.

E4M3, E5M2, U8 = _arrays.FLOAT8_E4M3, _arrays.FLOAT8_E5M2, np.dtype(np.uint8)


class _Dev0:
    id = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpArr(DevArray):
    """What the stand-in ``cupy.empty`` hands out: made-up memory with a CuPy array's ``device``."""

    __slots__ = ()
    device = _Dev0()


_CpArr.__module__ = "cupy._core.core"  # a CuPy array to moe_rt's Call


@pytest.fixture
def cupy_without_fp8(monkeypatch):
    """CuPy's array creation as CuPy 14.2 does it for FP8 (ValueError), made-up memory for anything else;
    CuPy views over device memory refuse FP8 the same way. Returns the arrays ``cupy.empty`` made."""
    import cupy

    mem, made = _Mem(), []

    def refuse(dtype):
        if np.dtype(dtype) in _arrays.FP8_DTYPES:
            raise ValueError(f"Unsupported dtype {np.dtype(dtype).name}")

    def empty(shape, dtype=F32, **kw):
        refuse(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        a = mem(shape, dtype)
        made.append(_CpArr(a.ptr, a.shape, a.dtype, a.owner, 0))
        return made[-1]

    def over(*args, **kw):
        refuse(args[2])
        raise AssertionError("no CuPy view of device memory is expected on this path")

    monkeypatch.setattr(cupy, "empty", empty)
    monkeypatch.setattr(_arrays, "_cupy_over", over)
    monkeypatch.setattr(_arrays, "_cupy_over_dense", over)
    return made


class _FakeCupy:
    """A CuPy array as moe_rt's Call sees one (framework 'cupy', on device 0)."""

    device = _Dev0()

    class flags:
        c_contiguous = True

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)
        self.size = math.prod(shape)
        self.data = DevArray(0x7A0000000000, self.shape, self.dtype, None, 0)


_FakeCupy.__module__ = "cupy._core.core"


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=lambda d: d.name)
def test_fp8_dispatch_cuda_path_moves_bytes_without_cupy_fp8(fake_device, cupy_without_fp8, fp8):
    mem = _Mem()
    T, K, E, H = 77, 4, 16, 96
    N = T * K
    plan = _fake_plan(mem, T, K, E, N)
    x, out = mem((T, H), fp8), mem((N, H), fp8)
    as_u8 = lambda a: DevArray(a.ptr, a.shape, U8, a.owner, 0)  # noqa: E731 - the same bytes as uint8
    want = []
    fake_device.calls.clear()
    with _arrays.serving([as_u8(out)], STREAM):
        P.dispatch.ordinary(as_u8(x), plan)
    want = list(fake_device.calls)
    assert want
    # served as a JAX callback serves XLA's buffers: FP8 is not recorded (the XLA-buffer and CuPy replays
    # would need CuPy to hold it); the ordinary path computes into the FP8 buffer, moving the bytes as uint8
    P.dispatch.recipes.clear()
    for fn in (P.dispatch.ordinary, P.dispatch, P.dispatch):
        fake_device.calls.clear()
        with _arrays.serving([out], STREAM):
            r, pp = fn(x, plan)
        assert type(r) is DevArray and r.dtype == fp8 and r.ptr == out.ptr and pp is None
        assert fake_device.calls == want
    assert list(P.dispatch.recipes.values()) == [_fast._SLOW]
    # not served: uint8 memory from CuPy, the FP8 dtype on the DevArray
    fake_device.calls.clear()
    r, _ = P.dispatch(x, plan)
    assert type(r) is DevArray and r.dtype == fp8 and r.shape == (N, H)
    assert r.owner is cupy_without_fp8[-1] and r.owner.dtype == U8 and r.ptr == r.owner.ptr
    assert [c[:3] for c in fake_device.calls] == [c[:3] for c in want]
    # the checks see the FP8 dtype: refused where rows are summed, naming the argument
    w = mem((T, K), F32)
    for args, kw, name in [((r, plan), {}, "y_permuted"), ((r, plan), dict(probs=w), "y_permuted"),
                           ((mem((T, H), fp8), plan), {}, "grad_y")]:
        op = P.combine if name == "y_permuted" else P.combine_backward
        for served in (False, True):
            with _arrays.serving([mem((T, H), F32)] if served else [], STREAM):
                with pytest.raises(TypeError, match=f"{name}: {fp8.name} rows cannot be summed"):
                    op(*args, **kw)
    with pytest.raises(TypeError, match=f"grad_x_permuted: {fp8.name} rows cannot be summed"):
        P.dispatch_backward(r, plan)


def test_fp8_quantize_cuda_path_allocates_uint8(fake_device, cupy_without_fp8):
    from moe_rt import fp8 as F

    mem = _Mem()
    T, H, block = 33, 300, 128
    nb = -(-H // block)
    x = mem((T, H), BF16)
    fake_device.calls.clear()
    q, s = F.quantize_fp8(x, block)
    assert type(q) is DevArray and q.dtype == E4M3 and q.shape == (T, H) and q.owner.dtype == U8
    assert s.dtype == F32 and s.shape == (T, nb)
    (call,) = fake_device.calls
    assert call[3][:3] == (x.ptr, q.ptr, s.data.ptr)
    outs = [mem((T, H), E4M3), mem((T, nb), F32)]
    with _arrays.serving(list(outs), STREAM):
        q2, s2 = F.quantize_fp8(x, block)
    assert (q2.ptr, q2.dtype, s2.ptr) == (outs[0].ptr, E4M3, outs[1].ptr)
    fake_device.calls.clear()
    y = F.dequantize_fp8(q, s, F32, block)
    assert y.dtype == F32 and fake_device.calls[0][3][:2] == (q.ptr, s.data.ptr)
    with pytest.raises(TypeError, match="x_fp8: expected float8_e4m3fn"):
        F.dequantize_fp8(mem((T, H), E5M2), s, F32, block)
    with pytest.raises(TypeError, match="x_fp8: expected float8_e4m3fn"):
        F.dequantize_fp8(mem((T, H), U8), s, F32, block)


def test_fp8_refused_for_cupy_callers_with_a_clear_error(fake_device, cupy_without_fp8):
    from moe_rt import fp8 as F

    mem = _Mem()
    T, K, E, H = 9, 2, 4, 32
    plan = _fake_plan(mem, T, K, E, T * K)
    with pytest.raises(TypeError, match=r"x: a cupy array, and the result would be FP8 \(float8_e4m3fn\)"):
        F.quantize_fp8(_FakeCupy((T, H), F32))
    scales = _FakeCupy((T, 1), F32)
    for fp8 in (E4M3, E5M2):
        with pytest.raises(TypeError, match=f"x: a CuPy {fp8.name} array"):
            P.dispatch(_FakeCupy((T, H), fp8), plan)
        with pytest.raises(TypeError, match=f"x_fp8: a CuPy {fp8.name} array"):
            F.dispatch_fp8(_FakeCupy((T, H), fp8), scales, plan)
    with pytest.raises(TypeError, match="x_fp8: a CuPy float8_e4m3fn array"):
        F.dequantize_fp8(_FakeCupy((T, H), E4M3), scales)
    assert cupy_without_fp8 == []  # refused before anything was allocated


def test_fp8_devarray_views_and_exports(cupy_without_fp8, monkeypatch):
    torch = pytest.importorskip("torch")
    seen = []

    def over(ptr, shape, dtype, nbytes, owner, dev):
        seen.append(dtype)
        return _CpArr(ptr, shape, dtype, owner, dev)

    monkeypatch.setattr(_arrays, "_cupy_over_dense", over)
    a = DevArray(0x7B0000000000, (3, 5), E5M2, object(), 0)
    u8 = a.cupy()
    assert seen == [U8] and u8.dtype == U8 and u8.ptr == a.ptr  # CuPy sees the bytes
    with pytest.raises(TypeError, match="float8_e5m2 values cannot be converted"):
        a.astype(F32)
    assert a.astype(E5M2, copy=False) is a
    assert a.export("devarray") is a
    for fw in ("cupy", "other"):
        with pytest.raises(TypeError, match=f"FP8 \\(float8_e5m2\\) result for a {fw} caller"):
            a.export(fw)
    # torch and JAX get their FP8 types over the uint8 export of the bytes
    monkeypatch.setattr(_arrays, "export", lambda arr, fw: torch.zeros(arr.shape, dtype=torch.uint8))
    t = a.export("torch")
    assert t.dtype == torch.float8_e5m2 and tuple(t.shape) == (3, 5)
    jnp = pytest.importorskip("jax.numpy")
    monkeypatch.setattr(_arrays, "export", lambda arr, fw: jnp.zeros(arr.shape, jnp.uint8))
    j = a.export("jax")
    assert j.dtype == jnp.float8_e5m2 and j.shape == (3, 5)


def test_fp8_torch_replay_still_recorded(fake_torch, monkeypatch):
    """torch replays allocate FP8 as torch tensors: FP8 dispatch stays recorded for torch callers."""
    drv, ft, torch = fake_torch
    mem = _Mem()
    T, K, E, H = 21, 2, 8, 64
    N = T * K
    plan = _fake_plan(mem, T, K, E, N)
    x = _FakeTensor(mem((T, H), U8).ptr, (T, H), torch.float8_e4m3fn)
    P.dispatch.recipes.clear()
    got = []
    for _ in range(2):
        ft.reset()
        drv.calls.clear()
        out, _ = P.dispatch(x, plan)
        assert out.dtype == torch.float8_e4m3fn and tuple(out.shape) == (N, H)
        got.append(list(drv.calls))
    assert got[0] == got[1] and got[0]
    (rec,) = P.dispatch.recipes.values()
    assert rec is not _fast._SLOW and [a[1] for a in rec.allocs] == [E4M3]


def test_fp8_dlpack_import_on_cuda_keeps_the_bytes_as_uint8(fake_device, cupy_without_fp8, monkeypatch):
    """An FP8 array exported by DLPack as FP8 (JAX does) is seen by CuPy as its uint8 bytes, the FP8 dtype on
    the DevArray; the op's checks see FP8."""
    from moe_rt import fp8 as F

    class View:  # what _dlpack.consume gives for a CUDA FP8 array
        device_type, device_id, dtype, shape, strides, ptr = "cuda", 0, E4M3, (6, 40), (40, 1), 0x7C0000000000
        size = span = 240

    class Producer:  # a DLPack producer on CUDA device 0
        def __dlpack__(self, stream=None, **kw):
            raise AssertionError("consumed through _dlpack.consume")

        def __dlpack_device__(self):
            return (2, 0)

    def wrap(view, dtype=None):
        dt = np.dtype(view.dtype if dtype is None else dtype)
        if dt in _arrays.FP8_DTYPES:
            raise ValueError(f"Unsupported dtype {dt.name}")
        return _CpArr(view.ptr, view.shape, dt, view, 0)

    monkeypatch.setattr(_arrays._dlpack, "consume", lambda obj, stream=None: View())
    monkeypatch.setattr(_arrays, "wrap", wrap)
    call = _arrays.Call({"x_fp8": Producer()})
    v = call["x_fp8"]
    assert type(v) is DevArray and v.dtype == E4M3 and v.shape == (6, 40) and v.ptr == View.ptr
    assert v.owner.dtype == U8
    with pytest.raises(TypeError, match="scales: dtype must be one of"):
        F.check_dispatch_fp8_args(v, v)
    F.check_dequantize_args(v, DevArray(0x7D0000000000, (6, 1), F32, None, 0), F32, 128)
