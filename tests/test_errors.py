"""Bad routing, one semantics on every backend (moe_rt._errors): expert ids outside [-1, E) raise the same
ValueError on CPU (at once) and on CUDA (at the next host-visible point: moe_rt.check(), EP host waits; at
once with validate=True or the debug switch). CPU tests: moe_rt.check() with no GPU, MOE_RT_DEBUG parsing,
the validate= keyword, the decoding of a device error word. GPU tests (``-m gpu``): bad ids E, E+5, -2 fed
to make_plan / dispatch / EpGroup on CuPy and torch CUDA arrays."""
import os
import subprocess
import sys

import numpy as np
import pytest

import moe_rt
import moe_rt.permutation as P
from moe_rt import _errors
from moe_rt.ep import EpGroup
from moe_rt.reference import permutation as R


def _cpu_message(fn):
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


def _bad_routing(rng, T, K, E, value, dtype=np.int32):
    """Tie-free random top-k routing with one slot (not the first) set to ``value``."""
    idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(dtype)
    t, k = int(rng.integers(1, T)), int(rng.integers(0, K))
    idx[t, k] = value
    return idx


@pytest.fixture(autouse=True)
def _debug_off():
    prev = moe_rt.set_debug(False)
    yield
    moe_rt.set_debug(prev)


# -- CPU: the public check with nothing on a device ------------------------------------------------------

def test_check_is_a_no_op_without_device_work(monkeypatch):
    monkeypatch.setattr(_errors, "_words", {})
    moe_rt.check()
    moe_rt.check(0)
    moe_rt.check(device=np.int64(3))
    moe_rt.check(stream=7)


@pytest.mark.parametrize("device,exc,match", [(True, TypeError, "device: expected a CUDA device id"),
                                               ("cuda:0", TypeError, "device: expected a CUDA device id"),
                                               (1.0, TypeError, "device"), (-1, ValueError, "device: .* >= 0")])
def test_check_rejects_bad_devices(device, exc, match):
    with pytest.raises(exc, match=match):
        moe_rt.check(device)


@pytest.mark.parametrize("stream", ["s", 1.5, True])
def test_check_rejects_bad_streams(stream):
    with pytest.raises(TypeError, match="stream: expected a CUDA stream"):
        moe_rt.check(stream=stream)


@pytest.mark.parametrize("value", [9, 13, -2, -(2**40)])
def test_cpu_raises_at_once_and_check_finds_nothing(rng, value):
    E = 8
    idx = _bad_routing(rng, 37, 3, E, value, np.int64)
    msg = _cpu_message(lambda: P.make_plan(idx, E))
    assert msg == f"routing: expert ids must be in [-1, num_experts={E}), got {value}"
    g = EpGroup(None, E, 4, 64)
    assert _cpu_message(lambda: g.prepare(idx)) == \
        f"topk_idx: expert ids must be in [-1, num_experts={E}), got {value}"
    moe_rt.check()  # the CPU path left nothing pending


def test_cpu_reports_the_first_bad_id_in_slot_order():
    idx = np.array([[0, 1], [-1, 7], [5, 2]], np.int32)
    assert _cpu_message(lambda: P.make_plan(idx, 4)).endswith("got 7")


# -- the debug switch ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value,want", [(None, False), ("", False), ("0", False), ("1", True)])
def test_parse_debug(value, want):
    assert _errors.parse_debug(value) is want


@pytest.mark.parametrize("value", ["2", "yes", "true", "on", " 1", "01"])
def test_parse_debug_rejects(value):
    with pytest.raises(ValueError, match=r"MOE_RT_DEBUG: expected 0 or 1, got " + repr(value)):
        _errors.parse_debug(value)


def _import_with(value):
    env = dict(os.environ, MOE_RT_DEBUG=value)
    return subprocess.run([sys.executable, "-c", "import moe_rt._errors as e; print(e.DEBUG)"], env=env,
                          capture_output=True, text=True, timeout=120)


def test_moe_rt_debug_is_read_at_import():
    r = _import_with("1")
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
    r = _import_with("yes")
    assert r.returncode != 0 and "MOE_RT_DEBUG: expected 0 or 1, got 'yes'" in r.stderr


def test_set_debug():
    assert moe_rt.set_debug(True) is False
    assert _errors.debug() is True and _errors.resolve_validate(None) is True
    assert moe_rt.set_debug(np.bool_(False)) is True
    assert _errors.resolve_validate(None) is False
    for bad in (1, "1", None):
        with pytest.raises(TypeError, match="enabled: expected a bool"):
            moe_rt.set_debug(bad)
    assert _errors.debug() is False


# -- the validate= keyword -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["yes", 1, 0.0, "True"])
def test_validate_must_be_a_bool(bad):
    idx = np.array([[0, 1], [2, -1]], np.int32)
    with pytest.raises(TypeError, match="validate: expected a bool or None"):
        P.make_plan(idx, 4, validate=bad)
    with pytest.raises(TypeError, match="validate: expected a bool or None"):
        EpGroup(None, 4, 8, 4).prepare(idx, validate=bad)


@pytest.mark.parametrize("validate", [None, True, False, np.bool_(True)])
def test_validate_on_cpu(rng, validate):
    E = 6
    good = np.argsort(rng.random((19, E)), axis=1)[:, :2].astype(np.int32)
    want = R.make_plan(good, E)
    p = P.make_plan(good, E, validate=validate)
    assert np.array_equal(p.dst_row, want["dst_row"])
    EpGroup(None, E, 8, 32).prepare(good, validate=validate)
    bad = _bad_routing(rng, 19, 2, E, E + 5)
    with pytest.raises(ValueError, match=rf"routing: expert ids must be in \[-1, num_experts={E}\), got {E + 5}$"):
        P.make_plan(bad, E, validate=validate)
    with pytest.raises(ValueError, match=rf"topk_idx: expert ids must be in \[-1, num_experts={E}\), got {E + 5}$"):
        EpGroup(None, E, 8, 32).prepare(bad, validate=validate)


# -- decoding a device's error word (host side, no GPU) -----------------------------------------------------

def _word(family, value, slot, E, flags=None):
    v, s = np.uint64(value & (2**64 - 1)), np.uint64(slot)
    lo = lambda x: int(x & np.uint64(0xFFFFFFFF))  # noqa: E731
    hi = lambda x: int(x >> np.uint64(32))  # noqa: E731
    return np.array([family if flags is None else flags, 1, lo(v), hi(v), lo(s), hi(s), E, family], np.uint32)


@pytest.mark.parametrize("family,name", [(_errors.MAKE_PLAN, "routing"), (_errors.EP_PREPARE, "topk_idx"),
                                         (_errors.EP_LL_DISPATCH, "topk_idx")])
@pytest.mark.parametrize("value", [8, 13, -2, 2**40 + 3, -(2**33)])
def test_error_word_gives_the_cpu_message(family, name, value):
    err = _errors.error_of(_word(family, value, 5 * 2**31 + 7, 8), 1)
    assert isinstance(err, ValueError)
    assert str(err) == f"{name}: expert ids must be in [-1, num_experts=8), got {value}"
    if hasattr(err, "__notes__"):
        assert "cuda:1 by " in err.__notes__[0] and f"slot {5 * 2**31 + 7} " in err.__notes__[0]


def test_error_word_names_the_other_family():
    err = _errors.error_of(_word(_errors.MAKE_PLAN, 9, 3, 4, flags=3), 0)
    assert str(err).startswith("routing:")
    if hasattr(err, "__notes__"):
        assert "EpGroup.prepare also met bad ids" in err.__notes__[0]


def test_raise_word_clears_only_on_error(monkeypatch):
    cleared = []
    monkeypatch.setattr(_errors, "_clear", lambda dev, stream: cleared.append((dev, stream)))
    _errors.raise_word(np.zeros(_errors.WORDS, np.uint32), 0, None)
    assert not cleared
    with pytest.raises(ValueError) as e:
        _errors.raise_word(_word(_errors.EP_PREPARE, 16, 0, 16), 2, "s")
    assert str(e.value) == "topk_idx: expert ids must be in [-1, num_experts=16), got 16"
    assert cleared == [(2, "s")]


def test_message_is_shared():
    assert _errors.message("routing", 4, np.int64(-3)) == "routing: expert ids must be in [-1, num_experts=4), got -3"


# ==================================================================================================
# GPU: bad ids on CUDA (CuPy and torch), make_plan / dispatch and a one-GPU EpGroup
# ==================================================================================================

BAD = ["E", "E+5", "-2"]


def _value(which, E):
    return {"E": E, "E+5": E + 5, "-2": -2}[which]


def _cp():
    import cupy

    return cupy


def _poison_pool(nbytes=64 << 20):
    """Free memory of CuPy's pool filled with 0xFF: anything the ops leave unwritten shows up."""
    cp = _cp()
    a = cp.empty(int(nbytes), dtype=cp.uint8)
    a.fill(0xFF)
    del a


def _asnumpy(a):
    return a.cpu().numpy() if hasattr(a, "cpu") else _cp().asnumpy(a)


def _to_device(idx, framework):
    if framework == "torch":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(idx).cuda()
    return _cp().asarray(idx)


def _tokens(rng, T, H, framework):
    x = rng.standard_normal((T, H)).astype(np.float32)
    if framework == "torch":
        import torch

        return x, torch.from_numpy(x).cuda()
    return x, _cp().asarray(x)


def _check_plan_and_dispatch(rng, plan, clean, E, A, framework):
    """The plan of the bad routing equals the reference plan of its cleaned routing (bad ids as -1), and so
    does the dispatch: nothing was written out of bounds (outputs come from a poisoned pool)."""
    ref = R.make_plan(clean, E, A)
    for k in ("dst_row", "src_slot", "seg_start", "counts", "tokens_per_expert"):
        np.testing.assert_array_equal(_asnumpy(getattr(plan, k)), ref[k], err_msg=k)
    x, xd = _tokens(rng, clean.shape[0], 40, framework)
    xp, _ = P.dispatch(xd, plan)
    np.testing.assert_array_equal(_asnumpy(xp), R.dispatch(x, ref)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("which", BAD)
def test_gpu_make_plan_records_and_check_raises(rng, framework, dtype, which):
    moe_rt.check()
    T, K, E, A = 301, 3, 12, 4
    v = _value(which, E)
    idx = _bad_routing(rng, T, K, E, v, dtype)
    clean = np.where(idx == v, -1, idx)
    want = _cpu_message(lambda: P.make_plan(idx, E, align_size=A))
    # twice: the first call of a signature prepares the core's kernels, the second finds them; both must
    # record the bad id
    for _ in range(2):
        _poison_pool()
        plan = P.make_plan(_to_device(idx, framework), E, align_size=A)  # no raise here: nothing syncs
        _check_plan_and_dispatch(rng, plan, clean, E, A, framework)
        with pytest.raises(ValueError) as e:
            moe_rt.check()
        assert str(e.value) == want
        moe_rt.check()  # cleared
        moe_rt.check(0)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("which", BAD)
def test_gpu_make_plan_validate_raises_at_once(rng, framework, which):
    moe_rt.check()
    T, K, E = 97, 2, 8
    v = _value(which, E)
    idx = _bad_routing(rng, T, K, E, v)
    want = _cpu_message(lambda: P.make_plan(idx, E))
    d = _to_device(idx, framework)
    with pytest.raises(ValueError) as e:
        P.make_plan(d, E, validate=True)
    assert str(e.value) == want
    moe_rt.check()  # the eager check cleared the word
    moe_rt.set_debug(True)
    with pytest.raises(ValueError) as e:
        P.make_plan(d, E)
    assert str(e.value) == want
    P.make_plan(d, E, validate=False)  # an explicit False wins over the switch
    moe_rt.set_debug(False)
    with pytest.raises(ValueError):
        moe_rt.check()
    good = np.where(idx == v, 0, idx)
    P.make_plan(_to_device(good, framework), E, validate=True)  # good ids: no error
    moe_rt.check()


@pytest.mark.gpu
def test_gpu_check_with_a_stream_and_the_first_error_wins(rng):
    cp = _cp()
    moe_rt.check()
    E = 8
    first = _bad_routing(rng, 50, 2, E, E + 5)
    second = _bad_routing(rng, 50, 2, E, -2)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        P.make_plan(cp.asarray(first), E)
        P.make_plan(cp.asarray(second), E)
    with pytest.raises(ValueError) as e:
        moe_rt.check(stream=s)
    assert str(e.value).endswith(f"got {E + 5}")
    moe_rt.check(stream=s)


EP_SIZES = dict(T=45, K=3, E=8, H=16, Tmax=64)


def _ep_case(rng, which, mode):
    """A one-GPU group of ``mode``, a routing with one bad id (``which``), and the CPU path's message."""
    moe_rt.check()
    T, K, E, H, Tmax = EP_SIZES.values()
    v = _value(which, E)
    idx = _bad_routing(rng, T, K, E, v)
    want = _cpu_message(lambda: EpGroup(None, E, H, Tmax, mode=mode).prepare(idx))
    assert want.startswith("topk_idx:")
    return EpGroup(None, E, H, Tmax, mode=mode), idx, v, want


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("which", BAD)
def test_gpu_ep_exact_prepare_raises(rng, framework, which):
    g, idx, v, want = _ep_case(rng, which, "exact")
    with pytest.raises(ValueError) as e:
        g.prepare(_to_device(idx, framework))  # exact mode: raised at the count read
    assert str(e.value) == want
    moe_rt.check()
    h = g.prepare(_to_device(np.where(idx == v, -1, idx), framework))
    g.check_overflow(h)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("which", BAD)
def test_gpu_ep_capacity_prepare_records(rng, framework, which):
    from moe_rt.reference import ep as ref

    g, idx, v, want = _ep_case(rng, which, "capacity")
    T, K, E, H, Tmax = EP_SIZES.values()
    clean = np.where(idx == v, -1, idx)
    # no raise in prepare (capacity mode never syncs) nor in dispatch; the slot is dropped
    _poison_pool()
    h = g.prepare(_to_device(idx, framework))
    x, xd = _tokens(rng, T, H, framework)
    rx, _, tpe = g.dispatch(h, xd)
    hs = ref.prepare([clean], E, pair_capacity=Tmax, capacity=Tmax * min(K, E))
    want_rx, _, want_tpe = ref.dispatch(hs, [x])[0]
    np.testing.assert_array_equal(_asnumpy(rx), want_rx)
    np.testing.assert_array_equal(_asnumpy(tpe), want_tpe)
    with pytest.raises(ValueError) as e:
        g.synchronize()
    assert str(e.value) == want
    moe_rt.check()
    # check_overflow reads the device: it raises the bad id first
    h = g.prepare(_to_device(idx, framework))
    with pytest.raises(ValueError) as e:
        g.check_overflow(h)
    assert str(e.value) == want
    # moe_rt.check raises it too
    g.prepare(_to_device(idx, framework))
    with pytest.raises(ValueError) as e:
        moe_rt.check()
    assert str(e.value) == want
    # validate=True: at once
    with pytest.raises(ValueError) as e:
        g.prepare(_to_device(idx, framework), validate=True)
    assert str(e.value) == want
    moe_rt.check()
