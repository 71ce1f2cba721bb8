"""moe_rt.l2_fetch_granularity: the opt-in L2 fetch size (bad input on any machine; read, set, restore and
unchanged results on a GPU)."""
import numpy as np
import pytest

import moe_rt


@pytest.mark.parametrize("bad, exc", [(48, ValueError), (0, ValueError), (256, ValueError), (-32, ValueError),
                                      (32.0, TypeError), ("32", TypeError), (True, TypeError)])
def test_l2_fetch_granularity_bad_nbytes(bad, exc):
    with pytest.raises(exc, match="nbytes"):
        moe_rt.l2_fetch_granularity(bad)


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (1.0, TypeError), ("0", TypeError), (True, TypeError)])
def test_l2_fetch_granularity_bad_device(bad, exc):
    with pytest.raises(exc, match="device"):
        moe_rt.l2_fetch_granularity(32, device=bad)


def test_l2_fetch_granularity_without_a_gpu_says_so():
    from conftest import GPU_COUNT

    if GPU_COUNT:
        pytest.skip("a CUDA GPU is present")
    for args in ((), (32,)):
        with pytest.raises(RuntimeError, match="l2_fetch_granularity needs a CUDA GPU; no CUDA GPU") as e:
            moe_rt.l2_fetch_granularity(*args)
        assert "insufficient" not in str(e.value) and "\n" not in str(e.value)


@pytest.mark.gpu
def test_l2_fetch_granularity_set_and_restore():
    import cupy as cp

    rng = np.random.default_rng(7)
    T, E, K = 1000 + 3, 256, 8
    x = cp.asarray(rng.permutation(T * E).reshape(T, E).astype(np.float32) / (T * E))  # tie-free
    g = cp.asarray(rng.standard_normal((T, E)).astype(np.float32))
    _, rmap, inter = moe_rt.topk_with_score(x, K)
    want = moe_rt.topk_with_score_backward(g, rmap, inter, K, score_function="softmax")
    before = moe_rt.l2_fetch_granularity()
    try:
        assert moe_rt.l2_fetch_granularity(32) == before
        assert moe_rt.l2_fetch_granularity() == 32
        got = moe_rt.topk_with_score_backward(g, rmap, inter, K, score_function="softmax")
        cp.testing.assert_array_equal(got, want)  # a fetch size changes speed, never results
        assert moe_rt.l2_fetch_granularity(128, device=0) == 32
        with pytest.raises(ValueError, match="device"):
            moe_rt.l2_fetch_granularity(32, device=cp.cuda.runtime.getDeviceCount())
    finally:
        moe_rt.l2_fetch_granularity(before)
    assert moe_rt.l2_fetch_granularity() == before
