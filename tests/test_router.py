"""Router ops: the NumPy reference on hand-worked cases and invariants, bad inputs, the CPU path through the
public API (NumPy, torch CPU), and (marker ``gpu``) every kernel against the reference."""
import math

import numpy as np
import pytest

import moe_rt.router as R
from moe_rt import _arrays
from moe_rt.reference import router as ref

F32 = np.float32
BF16 = _arrays.BFLOAT16


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


# ---- hand-worked cases ----------------------------------------------------------------------------------

def test_softmax_post_hand():
    x = np.array([[1.0, 3.0, 2.0, 0.0]], F32)
    probs, rmap, inter = ref.topk_with_score_fwd(x, 2, score_function="softmax")
    e = math.e
    np.testing.assert_array_equal(rmap, [[False, True, True, False]])
    np.testing.assert_allclose(probs, [[0, e / (e + 1), 1 / (e + 1), 0]], rtol=1e-6)
    assert inter[0, 0] == -np.inf and inter[0, 3] == -np.inf
    np.testing.assert_allclose(inter[0, 1:3], [e / (e + 1), 1 / (e + 1)], rtol=1e-6)


def test_softmax_pre_hand_no_renormalization():
    x = np.array([[1.0, 3.0, 2.0, 0.0]], F32)
    probs, rmap, inter = ref.topk_with_score_fwd(x, 2, score_function="softmax", use_pre_softmax=True,
                                                 scaling_factor=2.0)
    z = sum(math.exp(v) for v in (1, 3, 2, 0))
    np.testing.assert_array_equal(rmap, [[False, True, True, False]])
    np.testing.assert_allclose(probs, [[0, 2 * math.exp(3) / z, 2 * math.exp(2) / z, 0]], rtol=1e-6)
    np.testing.assert_allclose(inter, [[math.exp(v) / z for v in (1, 3, 2, 0)]], rtol=1e-6)


def test_sigmoid_bias_selection_only_with_revert():
    x = np.array([[0.0, 1.0, 2.0, 3.0]], F32)
    b = np.array([3.0, 0.0, 0.0, -3.0], F32)
    probs, rmap, inter = ref.topk_with_score_fwd(x, 2, score_function="sigmoid", expert_bias=b)
    np.testing.assert_array_equal(rmap, [[True, False, True, False]])  # biased: 3.5, .73, .88, -2.05
    a0 = float(F32(F32(F32(0.5) + F32(3)) - F32(3)))  # TE revert fl(fl(a+b)-b)
    a2 = sig(2.0)
    np.testing.assert_allclose(probs, [[a0 / (a0 + a2), 0, a2 / (a0 + a2), 0]], rtol=1e-6)
    np.testing.assert_allclose(inter, [[sig(v) for v in (0, 1, 2, 3)]], rtol=1e-6)


def test_bias_revert_is_not_exact_gather():
    # fl(fl(a + b) - b) != a when b is large: the oracle models TE's revert.
    x = np.array([[-3.0, 0.0]], F32)
    b = np.array([100.0, 0.0], F32)
    probs, _, _ = ref.topk_with_score_fwd(x, 1, score_function="sigmoid", expert_bias=b)
    a = F32(1) / (F32(1) + np.exp(F32(3)))
    assert probs[0, 0] == F32(F32(a + F32(100)) - F32(100))
    assert probs[0, 0] != a


def test_sqrtsoftplus_k1_no_normalization_and_scaling():
    x = np.array([[-1.0, 0.5, 25.0]], F32)
    probs, rmap, inter = ref.topk_with_score_fwd(x, 1, score_function="sqrtsoftplus", scaling_factor=2.0)
    np.testing.assert_array_equal(rmap, [[False, False, True]])
    np.testing.assert_allclose(probs, [[0, 0, 10.0]], rtol=1e-6)  # 2 * sqrt(25), threshold 20
    np.testing.assert_array_equal(inter, x)  # raw logits saved
    s, m, _ = ref.scores_for_aux_loss_fwd(x, 1, "sqrtsoftplus")  # aux scores: always normalized
    q = [math.sqrt(math.log1p(math.exp(-1))), math.sqrt(math.log1p(math.exp(0.5))), 5.0]
    np.testing.assert_allclose(s, [[v / sum(q) for v in q]], rtol=1e-6)


def test_grouped_topk_hand():
    x = np.array([[0.0, 9.0, 1.0, 2.0, 8.0, 7.0, 3.0, 3.5]], F32)
    # groups of 2; group score = sum of top-2: 9, 3, 15, 6.5 -> groups 0 and 2 -> experts 0,1,4,5
    probs, rmap, _ = ref.topk_with_score_fwd(x, 4, score_function="softmax", num_groups=4, group_topk=2)
    np.testing.assert_array_equal(rmap[0], [1, 1, 0, 0, 1, 1, 0, 0])
    ex = np.exp(np.array([0, 9, 8, 7], np.float64) - 9)
    np.testing.assert_allclose(probs[0, [0, 1, 4, 5]], ex / ex.sum(), rtol=1e-6)
    _, plain, _ = ref.topk_with_score_fwd(x, 4, score_function="softmax")
    np.testing.assert_array_equal(plain[0], [0, 1, 0, 0, 1, 1, 0, 1])


def test_grouped_top1_sum_vs_max():
    # m = K/g = 1: group score is the group max.
    x = np.array([[5.0, 0.0, 4.0, 4.5]], F32)
    _, rmap, _ = ref.topk_with_score_fwd(x, 1, score_function="sigmoid", num_groups=2, group_topk=1)
    np.testing.assert_array_equal(rmap[0], [1, 0, 0, 0])


def _core_fwd_plan(E, K, G, g, dtype, aligned=True):
    """The C core's forward launch for these settings (a planning context, an H100's facts):
    (kernel, (16-byte vector flag, grouped-selection word))."""
    from moe_rt import _core

    ctx = _core.planning()
    base = 1 << 20 if aligned else (1 << 20) + 4
    _core.topk_with_score(ctx, base, _core.CODES[np.dtype(dtype)], 128, E, K, 0, 0, G, g, 1.0, 0, 2 << 20, 3 << 20,
                          _core.CODES[np.dtype(np.bool_)], 4 << 20, 0)
    (launch,) = ctx.last_plan()
    return launch[1], launch[5]


def test_cmax_word_picks_the_chunk_maxima_group_scores():
    # the core's grouped-selection word: list capacity per group | lanes per group << 16, or 0
    assert _core_fwd_plan(2304, 36, 8, 4, BF16)[1] == (1, 28 | 4 << 16)  # (512 - 288) / 8 words a list
    assert _core_fwd_plan(2304, 36, 4, 2, BF16)[1] == (1, 56 | 8 << 16)
    assert _core_fwd_plan(2304, 64, 2, 1, BF16)[1] == (1, 112 | 16 << 16)
    assert _core_fwd_plan(2304, 36, 8, 4, F32)[1][1] == 0  # fp32: 4-key chunks
    assert _core_fwd_plan(2304, 36, 8, 4, BF16, aligned=False)[1] == (0, 0)  # not 16-byte rows
    assert _core_fwd_plan(4096, 36, 8, 4, BF16)[1][1] == 0  # 128 threads a token: not one warp
    assert _core_fwd_plan(2304, 64, 8, 2, BF16)[1][1] == 0  # m = 32 > 4 lanes * 4
    assert _core_fwd_plan(2304, 16, 8, 2, BF16)[1][1] == 0  # m = 8: the top-8 register path
    assert _core_fwd_plan(2040, 36, 12, 4, BF16)[1][1] == 0  # groups of 170: not whole 8-key chunks
    assert _core_fwd_plan(2304, 36, 0, 0, BF16)[1][1] == 0


def test_ties_lowest_index_and_nan_largest():
    x = np.array([[1.0, 2.0, 2.0, 2.0, 0.0], [0.0, np.nan, 1.0, np.inf, -0.0]], F32)
    _, rmap, _ = ref.topk_with_score_fwd(x, 2, score_function="softmax")
    np.testing.assert_array_equal(rmap[0], [0, 1, 1, 0, 0])
    np.testing.assert_array_equal(rmap[1], [0, 1, 0, 1, 0])
    probs, _, _ = ref.topk_with_score_fwd(x[1:], 2, score_function="softmax")
    assert np.isnan(probs[0, 1]) and np.isnan(probs[0, 3])
    assert ref.float_keys(np.array([-0.0], F32))[0] < ref.float_keys(np.array([0.0], F32))[0]


def test_aux_loss_hand():
    p = np.array([[0.1, 0.2], [0.3, 0.4]], F32)
    tpe = np.array([3, 1], np.int32)
    loss = ref.aux_loss_fwd(p, tpe, 2, 2, 1, 0.5)  # C = (2*0.5)/1/2/2 = 0.25; 0.25*(3*.4 + 1*.6)
    assert loss.shape == () and loss.dtype == F32
    np.testing.assert_allclose(loss, 0.45, rtol=1e-6)
    g = ref.aux_loss_bwd(np.array(2.0, F32), 3, tpe, 2, 2, 1, 0.5)
    np.testing.assert_allclose(g, [[1.5, 0.5]] * 3, rtol=1e-6)


def test_aux_loss_seq_columns():
    # C = 2E (seq aux loss): one count per column, E only in the coefficient.
    p = np.arange(8, dtype=F32).reshape(2, 4) / 10
    tpe = np.array([1, 2, 3, 4], np.int64)
    loss = R.aux_loss(p, tpe, 2, 2, 1, 1.0)
    c = 2 * 1.0 / 1 / 2 / 2
    np.testing.assert_allclose(loss, c * float((p.sum(0) * tpe).sum()), rtol=1e-6)


# ---- invariants ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("K", [1, 2, 5])
def test_invariants(rng, score, K):
    x = rng.standard_normal((37, 24)).astype(F32)
    for pre in ([False, True] if score == "softmax" else [False]):
        probs, rmap, inter = ref.topk_with_score_fwd(x, K, score_function=score, use_pre_softmax=pre,
                                                     scaling_factor=1.5)
        assert (rmap.sum(1) == K).all()
        assert (probs[~rmap] == 0).all()
        if not pre and (score == "softmax" or K > 1):
            np.testing.assert_allclose(probs.sum(1), 1.5, rtol=1e-5)
        idx, w = ref.topk_indices_fwd(x, K, score_function=score, use_pre_softmax=pre, scaling_factor=1.5)
        np.testing.assert_array_equal(np.take_along_axis(rmap, idx.astype(np.int64), 1), True)
        np.testing.assert_allclose(w, np.take_along_axis(probs, idx.astype(np.int64), 1), rtol=1e-6)
        assert (np.diff(idx, axis=1) > 0).all()
    s, m, _ = ref.scores_for_aux_loss_fwd(x, K, score)
    np.testing.assert_allclose(s.sum(1), 1.0, rtol=1e-5)
    assert (m.sum(1) == K).all()


# ---- backward vs finite differences ------------------------------------------------------------------

def _fd_check(f, x, gy, dx, h=1e-2, tol=2e-3):
    x64 = x.astype(np.float64)
    num = np.zeros_like(x64)
    for i in np.ndindex(x.shape):
        xp, xm = x64.copy(), x64.copy()
        xp[i] += h
        xm[i] -= h
        num[i] = (np.sum(gy * f(xp.astype(F32))) - np.sum(gy * f(xm.astype(F32)))) / (2 * h)
    np.testing.assert_allclose(dx, num, atol=tol, rtol=tol)


@pytest.mark.parametrize("score,pre,K,bias", [("softmax", False, 3, False), ("softmax", True, 3, False),
                                              ("sigmoid", False, 3, True), ("sigmoid", False, 1, False),
                                              ("sqrtsoftplus", False, 3, True), ("sqrtsoftplus", False, 1, False)])
def test_backward_finite_differences(rng, score, pre, K, bias):
    E = 9
    x = (rng.permutation(E) * 0.7 - 3).astype(F32)[None].repeat(2, 0)
    x[1] = x[1][::-1]
    x[1, 0] = 21.0 if score == "sqrtsoftplus" else x[1, 0]  # exercise the softplus threshold branch
    b = (rng.standard_normal(E) * 0.05).astype(F32) if bias else None
    kw = dict(score_function=score, use_pre_softmax=pre, scaling_factor=1.3, expert_bias=b)
    gy = rng.standard_normal(x.shape).astype(F32)
    probs, rmap, inter = ref.topk_with_score_fwd(x, K, **kw)
    dx = ref.topk_with_score_bwd(gy, rmap, inter, K, pre, 1.3, score)

    def f(xx):
        p, m, _ = ref.topk_with_score_fwd(xx, K, **kw)
        assert (m == rmap).all()
        return p.astype(np.float64)

    # the biased revert fl(fl(a+b)-b) is not differentiable to fp32 precision: looser check with bias
    _fd_check(f, x, gy, dx, tol=5e-3 if bias else 2e-3)


@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_scores_backward_finite_differences(rng, score):
    x = rng.standard_normal((2, 7)).astype(F32)
    gy = rng.standard_normal(x.shape).astype(F32)
    _, _, inter = ref.scores_for_aux_loss_fwd(x, 2, score)
    dx = ref.scores_for_aux_loss_bwd(gy, inter, 2, score)
    _fd_check(lambda xx: ref.scores_for_aux_loss_fwd(xx, 2, score)[0].astype(np.float64), x, gy, dx)


# ---- public API on CPU ----------------------------------------------------------------------------------

def test_public_cpu_numpy_matches_reference(rng):
    x = rng.standard_normal((3, 5, 16)).astype(F32)
    b = rng.standard_normal(16).astype(F32) * 0.1
    kw = dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5, expert_bias=b)
    probs, rmap, inter = R.topk_with_score(x, 4, **kw)
    assert probs.shape == (3, 5, 16) and rmap.dtype == np.bool_ and inter.dtype == F32
    rp, rm, ri = ref.topk_with_score_fwd(x.reshape(-1, 16), 4, **kw)
    np.testing.assert_array_equal(probs.reshape(-1, 16), rp)
    np.testing.assert_array_equal(rmap.reshape(-1, 16), rm)
    idx, w = R.topk_indices_with_score(x, 4, **kw)
    assert idx.shape == (3, 5, 4) and idx.dtype == np.int32 and w.dtype == F32
    g = rng.standard_normal(x.shape).astype(F32)
    dx = R.topk_with_score_backward(g, rmap, inter, 4, score_function="sigmoid", scaling_factor=2.5)
    assert dx.shape == x.shape and dx.dtype == F32
    s, m, i2 = R.scores_for_aux_loss(x, 4, "softmax")
    assert s.dtype == F32 and m.shape == x.shape
    d2 = R.scores_for_aux_loss_backward(g, i2, 4, "softmax", dtype="bfloat16")
    assert d2.dtype == BF16
    loss = R.aux_loss(s.reshape(-1, 16), m.reshape(-1, 16).sum(0).astype(np.int32), 15, 16, 4, 0.01)
    assert loss.shape == ()
    gl = R.aux_loss_backward(np.array(1.0, F32), 15, m.reshape(-1, 16).sum(0), 15, 16, 4, 0.01)
    assert gl.shape == (15, 16)


def test_public_cpu_zero_tokens():
    x = np.zeros((0, 8), F32)
    probs, rmap, inter = R.topk_with_score(x, 2)
    assert probs.shape == (0, 8) and rmap.shape == (0, 8)
    idx, w = R.topk_indices_with_score(x, 2)
    assert idx.shape == (0, 2)


def test_public_cpu_torch(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(6, 32)
    probs, rmap, inter = R.topk_with_score(x, 4, score_function="softmax", use_pre_softmax=True)
    assert isinstance(probs, torch.Tensor) and rmap.dtype == torch.bool and inter.dtype == torch.float32
    rp, rm, _ = ref.topk_with_score_fwd(x.numpy(), 4, score_function="softmax", use_pre_softmax=True)
    np.testing.assert_array_equal(probs.numpy(), rp)
    xb = x.to(torch.bfloat16)
    pb, mb, ib = R.topk_with_score(xb, 2, score_function="sigmoid")
    assert pb.dtype == torch.bfloat16
    dx = R.topk_with_score_backward(torch.ones_like(pb), mb, ib, 2, score_function="sigmoid")
    assert dx.dtype == torch.bfloat16 and dx.shape == xb.shape
    loss = R.aux_loss(torch.rand(4, 32), torch.arange(32, dtype=torch.int64), 4, 32, 4, 0.1)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0


def test_nan_cpu():
    x = np.array([[0.0, np.nan, 1.0, 2.0]], F32)
    for score, pre in (("softmax", False), ("softmax", True), ("sigmoid", False)):
        probs, rmap, _ = R.topk_with_score(x, 2, score_function=score, use_pre_softmax=pre)
        if pre:
            np.testing.assert_array_equal(rmap[0], [1, 1, 0, 0])
        else:
            np.testing.assert_array_equal(rmap[0], [0, 1, 0, 1])
        assert np.isnan(probs[rmap]).all()


def test_nan_signs_and_payloads_equal_cpu():
    # NaNs of either sign, quiet or signaling, with payloads: all equal and above +inf, so the lowest indices
    # win among them. With groups of 2 and m = 2, groups 1-3 each hold a NaN, so their scores are NaN and
    # equal: group 1, the lowest, is taken (experts 2 and 3), not group 0 with +inf
    nans = np.array([0xFFC00000, 0x7F800001, 0xFF812345, 0x7FC12345], np.uint32).view(F32)
    x = np.array([[np.inf, 5.0, nans[0], 1.0, nans[1], nans[2], 2.0, nans[3]]], F32)
    for score in ("softmax", "sigmoid", "sqrtsoftplus"):
        _, rmap, _ = R.topk_with_score(x, 3, score_function=score)
        np.testing.assert_array_equal(rmap[0], [0, 0, 1, 0, 1, 1, 0, 0])
    bias = np.linspace(0.5, 0.0, 8).astype(F32)
    _, rmap, _ = R.topk_with_score(x, 2, score_function="sigmoid", expert_bias=bias, num_groups=4, group_topk=1)
    np.testing.assert_array_equal(rmap[0], [0, 0, 1, 1, 0, 0, 0, 0])


# ---- bad inputs ----------------------------------------------------------------------------------------

BAD = [
    (dict(x=np.zeros((4, 8), np.float64)), TypeError, "logits"),
    (dict(x=np.zeros(8, F32)), ValueError, "logits"),
    (dict(topk=0), ValueError, "topk"),
    (dict(topk=9), ValueError, "topk"),
    (dict(topk=2.0), TypeError, "topk"),
    (dict(num_groups=3, group_topk=1), ValueError, "num_groups"),
    (dict(num_groups=4, group_topk=5, topk=5), ValueError, "group_topk"),
    (dict(num_groups=4, group_topk=2, topk=3), ValueError, "group_topk"),
    (dict(num_groups=4, group_topk=1, topk=4), ValueError, "topk/group_topk"),
    (dict(group_topk=2), ValueError, "num_groups"),
    (dict(score_function="sigmoid", expert_bias=np.zeros(7, F32)), ValueError, "expert_bias"),
    (dict(score_function="sigmoid", expert_bias=np.zeros(8, np.int32)), TypeError, "expert_bias"),
    (dict(expert_bias=np.zeros(8, F32)), ValueError, "expert_bias"),
    (dict(score_function="relu"), ValueError, "score_function"),
    (dict(scaling_factor=float("nan")), ValueError, "scaling_factor"),
    (dict(scaling_factor=float("inf")), ValueError, "scaling_factor"),
    (dict(scaling_factor="2"), TypeError, "scaling_factor"),
]


@pytest.mark.parametrize("kw,exc,word", BAD)
def test_bad_inputs_topk(kw, exc, word):
    kw = dict(kw)
    x = kw.pop("x", np.zeros((4, 8), F32))
    topk = kw.pop("topk", 2)
    with pytest.raises(exc, match=word.replace("/", ".")):
        R.topk_with_score(x, topk, **kw)
    with pytest.raises(exc, match=word.replace("/", ".")):
        R.topk_indices_with_score(x, topk, **kw)


def test_launch_geometry():
    # the core's kernel for groups held in the lanes (8 keys a lane, k <= 8): at most 32 groups, a power-of-two
    # count of 16-byte chunks per group, at most 8 keys summed a group
    lanes = lambda E, K, G, g, dt: _core_fwd_plan(E, K, G, g, dt)[0].endswith("8, true, true>")  # noqa: E731
    assert lanes(256, 8, 8, 4, BF16)  # bf16: 4 chunks a group
    assert lanes(256, 8, 8, 4, F32)  # fp32: 8 chunks a group
    assert not lanes(256, 8, 64, 4, BF16)  # 64 groups
    assert not lanes(192, 8, 4, 4, BF16)  # 6 chunks a group
    assert not lanes(256, 8, 0, 0, BF16)  # no groups
    assert not lanes(256, 36, 4, 4, BF16)  # 9 keys summed a group
    # tokens per warp: ceil(T / (slots * tpw)) blocks; 0: at most one resident wave
    assert R._tpw_grid(65536, 4, 2, 1056) == 8192
    assert R._tpw_grid(65537, 4, 1, 1056) == 16385
    assert R._tpw_grid(65536, 4, 0, 1056) == 1056
    assert R._tpw_grid(5, 4, 0, 1056) == 2
    assert R._tpw_grid(0, 4, 2, 1056) == R._tpw_grid(0, 4, 0, 1056) == 1


def test_bad_inputs_other():
    x = np.zeros((4, 8), F32)
    m = np.zeros((4, 8), bool)
    with pytest.raises(TypeError, match="routing_map"):
        R.topk_with_score_backward(x, m.astype(F32), x, 2, score_function="softmax")
    with pytest.raises(TypeError, match="intermediate"):
        R.topk_with_score_backward(x, m, x.astype(np.float16), 2, score_function="softmax")
    with pytest.raises(ValueError, match="intermediate"):
        R.topk_with_score_backward(x, m, x[:2], 2, score_function="softmax")
    with pytest.raises(ValueError, match="score_function"):
        R.topk_with_score_backward(x, m, x, 2, score_function="tanh")
    with pytest.raises(ValueError, match="topk"):
        R.scores_for_aux_loss(x, 9, "softmax")
    with pytest.raises(TypeError, match="grad_scores"):
        R.scores_for_aux_loss_backward(x.astype(np.float16), x, 2, "softmax")
    with pytest.raises(TypeError, match="dtype"):
        R.scores_for_aux_loss_backward(x, x, 2, "softmax", dtype=np.int32)
    tpe = np.ones(8, np.int32)
    with pytest.raises(ValueError, match="num_experts"):
        R.aux_loss(x, tpe, 4, 3, 2, 0.1)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        R.aux_loss(x, tpe[:4], 4, 8, 2, 0.1)
    with pytest.raises(TypeError, match="tokens_per_expert"):
        R.aux_loss(x, tpe.astype(np.uint8), 4, 8, 2, 0.1)
    with pytest.raises(ValueError, match="total_num_tokens"):
        R.aux_loss(x, tpe, 0, 8, 2, 0.1)
    with pytest.raises(ValueError, match="coeff"):
        R.aux_loss(x, tpe, 4, 8, 2, float("nan"))
    with pytest.raises(ValueError, match="probs"):
        R.aux_loss(x[0], tpe, 4, 8, 2, 0.1)
    with pytest.raises(ValueError, match="grad_aux_loss"):
        R.aux_loss_backward(np.ones(3, F32), 4, tpe, 4, 8, 2, 0.1)


# ---- GPU: kernels against the reference ----------------------------------------------------------------

def _tie_free(rng, T, E, dtype):
    """Rows are random permutations of an evenly spaced grid: no two values of a row tie, and distinct
    values stay far apart after the score functions (also after rounding to bf16: equal bf16 values are
    exact ties, resolved identically by both sides)."""
    base = np.linspace(-4, 4, E, dtype=np.float64)
    x = np.stack([rng.permutation(base) for _ in range(T)]) if T else np.zeros((0, E))
    x = x + rng.uniform(-1, 1, (T, 1))
    return x.astype(F32).astype(dtype)


def _tol(E):
    return max(1e-5, 4e-7 * E)


def _close(got, want, dtype, E, what):
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    assert got.shape == want.shape, what
    if dtype == BF16:
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-5, err_msg=what)
    elif dtype == np.float16:
        np.testing.assert_allclose(got, want, rtol=2 ** -10, atol=1e-5, err_msg=what)
    else:
        t = _tol(E)
        np.testing.assert_allclose(got, want, rtol=t, atol=t, err_msg=what)


# (T, E, K, dtype, score, pre, groups, bias, scale)
GPU_CASES = [
    (0, 256, 8, F32, "softmax", False, None, False, None),
    (1, 8, 1, F32, "softmax", False, None, False, None),
    (7, 8, 2, BF16, "sigmoid", False, (4, 2), True, 2.5),
    (4099, 256, 8, F32, "softmax", False, None, False, None),
    (4099, 256, 8, BF16, "sigmoid", False, (8, 4), True, 2.5),
    (4099, 256, 8, F32, "softmax", True, (8, 4), False, 1.0),
    (7, 130, 2, F32, "sqrtsoftplus", False, None, True, None),
    (4099, 130, 36, BF16, "softmax", False, None, False, 1.2),
    (7, 130, 26, F32, "sigmoid", False, (10, 2), False, None),
    (7, 256, 64, F32, "sigmoid", False, (4, 2), False, None),
    (1, 256, 64, BF16, "sqrtsoftplus", False, (8, 8), False, None),
    (4099, 2304, 36, F32, "softmax", False, None, False, None),
    (4099, 2304, 36, BF16, "sigmoid", False, (8, 4), True, None),
    (517, 2304, 36, F32, "sigmoid", False, (8, 4), True, None),
    (517, 1020, 36, F32, "sigmoid", False, (5, 4), True, None),  # groups of 204: 4-key units, 4-key rounds
    # 16-bit rows whose group scores come from phase 1's chunk maxima (router._cmax_word): 4 lanes a group,
    # 8, 16; other score functions; fp16
    (517, 2304, 36, np.float16, "sigmoid", False, (8, 4), True, None),
    (517, 2304, 36, BF16, "sqrtsoftplus", False, (8, 4), True, 1.5),
    (517, 2304, 36, BF16, "softmax", False, (8, 4), False, None),
    (517, 2304, 36, BF16, "sigmoid", False, (4, 2), True, None),
    (129, 2304, 64, BF16, "sigmoid", False, (2, 1), True, None),
    (7, 2304, 8, BF16, "softmax", True, None, False, None),
    (7, 2304, 1, F32, "sqrtsoftplus", False, None, False, None),
    (7, 16384, 64, F32, "softmax", False, None, False, None),
    (7, 16384, 36, BF16, "sigmoid", False, (64, 4), True, None),
    (1, 16384, 2, np.float16, "softmax", True, None, False, None),
    (7, 16384, 8, F32, "sqrtsoftplus", False, (2, 1), False, None),
    # short rows: a token on each segment of 4, 8 or 16 lanes (csrc/router.c seg_lanes), tails of the warp's
    # tokens included
    (4099, 64, 8, F32, "softmax", False, None, False, None),
    (4099, 64, 8, BF16, "softmax", True, None, False, 1.5),
    (517, 32, 4, F32, "sigmoid", False, None, True, 2.0),
    (517, 128, 8, BF16, "sqrtsoftplus", False, None, True, None),
    (37, 60, 6, F32, "sigmoid", False, None, False, None),
    (37, 16, 5, F32, "softmax", False, None, False, None),
    (38, 8, 2, BF16, "softmax", False, None, False, None),
]


def _maps_agree(got, want, sel_keys, K):
    """Exact match, except rows where the boundary is a near tie (bias/group sums make ties of computed
    values possible): there the K-th and (K+1)-th reference keys must be within a few fp32 ulps."""
    bad = np.nonzero((got != want).any(1))[0]
    for t in bad:
        k = np.sort(sel_keys[t].astype(np.int64))[::-1]
        assert k[K - 1] - k[K] <= 8, f"row {t}: maps differ away from a tie"
    assert len(bad) <= max(1, len(got) // 100), f"{len(bad)} rows differ"
    return bad


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-K{c[2]}-{np.dtype(c[3]).name}-{c[4]}"
                         f"{'-pre' if c[5] else ''}{'-g' if c[6] else ''}{'-b' if c[7] else ''}")
def test_gpu_topk_vs_reference(rng, case):
    import cupy as cp

    T, E, K, dtype, score, pre, groups, bias, scale = case
    x = _tie_free(rng, T, E, dtype)
    b = (rng.permutation(E) * (0.5 / E)).astype(F32) if bias else None
    kw = dict(score_function=score, use_pre_softmax=pre, num_groups=groups[0] if groups else None,
              group_topk=groups[1] if groups else None, scaling_factor=scale, expert_bias=b)
    gkw = dict(kw, expert_bias=None if b is None else cp.asarray(b))
    probs, rmap, inter = R.topk_with_score(cp.asarray(x), K, **gkw)
    rp, rm, ri = ref.topk_with_score_fwd(x, K, **kw)
    probs, rmap, inter = probs.get(), rmap.get(), inter.get()
    assert probs.dtype == x.dtype and rmap.dtype == np.bool_ and inter.dtype == F32
    # selection keys the reference used (for the near-tie rule)
    x32 = x.astype(F32)
    if score == "softmax":
        sk = ref.float_keys(ri if pre else x32)
    else:
        a = ri if score == "sigmoid" else ref._sqrtsoftplus(x32)
        sk = ref.float_keys(a + (b if b is not None else 0))
    exact = not bias and not groups
    if exact:
        np.testing.assert_array_equal(rmap, rm)
        ok = np.ones(T, bool)
    else:
        ok = np.ones(T, bool)
        ok[_maps_agree(rmap, rm, sk, K)] = False
    assert (rmap.sum(1) == K).all()
    _close(probs[ok], rp[ok], x.dtype, E, "probs")
    _close(inter[ok], ri[ok], F32, E, "intermediate")
    # compact form
    idx, w = R.topk_indices_with_score(cp.asarray(x), K, **gkw)
    idx, w = idx.get(), w.get()
    np.testing.assert_array_equal(idx[ok], np.sort(np.argsort(~rmap, 1, kind="stable")[:, :K], 1)[ok])
    rp32, _, _ = ref.topk_with_score_fwd_fp32(x, K, **kw)
    _close(w[ok], np.take_along_axis(rp32, idx.astype(np.int64), 1)[ok], F32, E, "topk_weights")
    # backward with random grads, on the GPU's own forward outputs
    gy = rng.standard_normal((T, E)).astype(F32).astype(dtype)
    dx = R.topk_with_score_backward(cp.asarray(gy), cp.asarray(rmap), cp.asarray(inter), K,
                                    score_function=score, use_pre_softmax=pre, scaling_factor=scale).get()
    rdx = ref.topk_with_score_bwd(gy, rmap, inter, K, pre, scale, score)
    assert dx.dtype == x.dtype
    if dtype == F32:
        _close(dx, rdx, F32, E, "grad_logits")
    else:
        scale_row = np.abs(rdx.astype(F32)).max(1, keepdims=True) + 1e-30
        np.testing.assert_allclose(dx.astype(F32) / scale_row, rdx.astype(F32) / scale_row, atol=2 ** -7)
    # bitwise reproducible
    p2, _, _ = R.topk_with_score(cp.asarray(x), K, **gkw)
    assert (p2.get().view(np.uint8) == probs.view(np.uint8)).all()


QUICK_CASES = [(E, dt, score, bias, pre, aux, None) for E in (256, 520, 1000, 2304) for dt in (F32, BF16)
               for score, bias, pre, aux in (("softmax", False, False, False), ("softmax", False, True, False),
                                             ("sigmoid", False, False, False), ("sigmoid", True, False, False),
                                             ("sqrtsoftplus", True, False, False), ("sqrtsoftplus", False, False, False),
                                             ("sigmoid", False, False, True), ("softmax", False, False, True),
                                             ("sqrtsoftplus", False, False, True))]
QUICK_CASES += [(E, dt, score, bias, False, False, grp) for E in (256, 512, 1024, 2304) for dt in (F32, BF16)
                for score, bias, grp in (("sigmoid", True, (8, 4)), ("softmax", False, (4, 2)),
                                         ("sqrtsoftplus", True, (16, 8)))]
QUICK_CASES = [c + (8,) for c in QUICK_CASES]
# K > 8 with groups: the group stand-in with every path (K <= 8 above: the one compiled without those of K > 8)
QUICK_CASES += [(E, dt, score, bias, False, False, grp, 16) for E in (1024, 2304) for dt in (F32, BF16)
                for score, bias, grp in (("sigmoid", True, (8, 4)), ("softmax", False, (4, 1)))]


@pytest.fixture(scope="module")
def stand_in_folder(tmp_path_factory):
    """A kernel cache folder that never gets the router's kernels: its first calls run their stand-ins."""
    return tmp_path_factory.mktemp("stand_in_cache")


@pytest.mark.gpu
@pytest.mark.parametrize("case", QUICK_CASES, ids=lambda c: f"E{c[0]}-{np.dtype(c[1]).name}-{c[2]}"
                         f"{'-b' if c[3] else ''}{'-pre' if c[4] else ''}{'-aux' if c[5] else ''}"
                         f"{f'-g{c[6][0]}x{c[6][1]}' if c[6] else ''}{f'-k{c[7]}' if c[7] != 8 else ''}")
def test_gpu_stand_ins_give_the_same_bits(rng, monkeypatch, stand_in_folder, case):
    """A stand-in (a quick kernel the C core runs on a first call while the router kernel compiles: moe_rt._jit's
    stand-ins, csrc/router.c fwd_stand_in) writes the bits the kernel it stands in for writes, on every output:
    the same calls on device 0's context with the kernels, then on a fresh context over a folder without them,
    whose background compiles never start."""
    import cupy as cp

    from moe_rt import _core, _jit

    E, dtype, score, bias, pre, aux, grp, k = case
    x = cp.asarray(_tie_free(rng, 1031, E, dtype))
    gkw = dict(num_groups=grp[0], group_topk=grp[1]) if grp else {}
    b = cp.asarray((rng.permutation(E) * (0.5 / E)).astype(F32)) if bias else None

    def run():
        if aux:
            out = R.scores_for_aux_loss(x, k, score)
        else:
            kw = dict(score_function=score, use_pre_softmax=pre, expert_bias=b, **gkw)
            out = R.topk_with_score(x, k, **kw) + R.topk_indices_with_score(x, k, **kw)
        return [o.get() for o in out]

    monkeypatch.setattr(_jit, "TIERED", False)
    want = run()
    monkeypatch.setattr(_jit, "TIERED", True)
    monkeypatch.setenv("MOE_RT_KERNEL_CACHE", str(stand_in_folder))
    monkeypatch.setattr(_jit, "compile_in_background", lambda *a: True)
    monkeypatch.setattr(_core, "_devices", {})
    n0 = _jit.stand_ins_loaded
    got = run()
    if dtype == BF16 and E // 8 <= 32 and not grp:
        pass  # bf16 at 8 keys a lane runs the kernel compiled without groups, which has no stand-in
    elif grp and E == 256:
        pass  # groups held in the lanes: a kernel compiled for that path alone, which has no stand-in
    else:
        assert _jit.stand_ins_loaded > n0
    for w, g in zip(want, got):
        assert (np.ascontiguousarray(w).view(np.uint8) == np.ascontiguousarray(g).view(np.uint8)).all()


AUX_CASES = [(0, 256, 8, F32, "softmax"), (1, 8, 1, F32, "sigmoid"), (4099, 256, 8, F32, "sigmoid"),
             (4099, 64, 8, BF16, "softmax"), (517, 32, 4, F32, "sigmoid"), (37, 48, 6, F32, "sqrtsoftplus"),
             (4099, 256, 8, BF16, "softmax"), (7, 130, 36, F32, "sqrtsoftplus"), (4099, 2304, 36, BF16, "sigmoid"),
             (7, 16384, 64, F32, "softmax"), (7, 16384, 8, BF16, "sqrtsoftplus")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", AUX_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-K{c[2]}-{np.dtype(c[3]).name}-{c[4]}")
def test_gpu_aux_scores_vs_reference(rng, case):
    import cupy as cp

    T, E, K, dtype, score = case
    x = _tie_free(rng, T, E, dtype)
    s, m, i = (a.get() for a in R.scores_for_aux_loss(cp.asarray(x), K, score))
    rs, rm, ri = ref.scores_for_aux_loss_fwd(x, K, score)
    np.testing.assert_array_equal(m, rm)
    _close(s, rs, F32, E, "scores")
    _close(i, ri, F32, E, "intermediate")
    gy = rng.standard_normal((T, E)).astype(F32)
    dx = R.scores_for_aux_loss_backward(cp.asarray(gy), cp.asarray(i), K, score, dtype=x.dtype).get()
    rdx = ref.scores_for_aux_loss_bwd(gy, i, K, score)
    assert dx.dtype == x.dtype
    if dtype == F32:
        _close(dx, rdx, F32, E, "grad_logits")
    else:
        sc = np.abs(rdx).max(1, keepdims=True) + 1e-30
        np.testing.assert_allclose(dx.astype(F32) / sc, rdx / sc, atol=2 ** -7)


@pytest.mark.gpu
@pytest.mark.parametrize("R_,C,E,dtype,tdt", [(0, 256, 256, F32, np.int32), (1, 8, 8, F32, np.int64),
                                              (4099, 256, 256, F32, np.int32), (4099, 512, 256, BF16, F32),
                                              (7, 130, 130, F32, np.int32), (513, 16384, 16384, F32, np.int64),
                                              (33, 2304, 2304, np.float16, np.int32)])
def test_gpu_aux_loss(rng, R_, C, E, dtype, tdt):
    import cupy as cp

    p = rng.random((R_, C)).astype(F32).astype(dtype)
    tpe = rng.integers(1, 1000, C).astype(tdt)
    args = (max(R_, 1), E, 8, 0.01)
    l1 = R.aux_loss(cp.asarray(p), cp.asarray(tpe), *args)
    l2 = R.aux_loss(cp.asarray(p), cp.asarray(tpe), *args)
    assert l1.shape == () and l1.dtype == p.dtype
    assert l1.get().tobytes() == l2.get().tobytes()  # deterministic
    want = ref.aux_loss_fwd(p, tpe, *args)
    np.testing.assert_allclose(float(l1.get().astype(F32)), float(want.astype(F32)),
                               rtol=1e-5 if dtype == F32 else 2 ** -7, atol=1e-30)
    g = np.array(1.7, F32).astype(dtype)
    gp = R.aux_loss_backward(cp.asarray(g), R_, cp.asarray(tpe), *args).get()
    _close(gp, ref.aux_loss_bwd(g, R_, tpe, *args), dtype, 1, "grad_probs")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gpu_nan_rows(dtype):
    import cupy as cp

    x = np.random.default_rng(0).standard_normal((5, 64)).astype(F32)
    x[1, 7] = np.nan
    x[3, :] = np.nan
    x = x.astype(dtype)
    for score, pre in (("softmax", False), ("softmax", True), ("sigmoid", False), ("sqrtsoftplus", False)):
        gp, gm, _ = R.topk_with_score(cp.asarray(x), 4, score_function=score, use_pre_softmax=pre)
        rp, rm, _ = R.topk_with_score(x, 4, score_function=score, use_pre_softmax=pre)
        np.testing.assert_array_equal(gm.get(), rm)
        np.testing.assert_array_equal(np.isnan(gp.get()), np.isnan(rp))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("E,K,groups", [(256, 8, (8, 4)), (2304, 36, (8, 4)), (2304, 8, None)])
def test_gpu_nan_signs_and_payloads(dtype, E, K, groups):
    """NaN logits of either sign and any payload are all the largest key and equal to each other (lowest
    index first), through every score function, with and without bias and groups (keys of sigmoid values
    skip the kernel's NaN test: the GPU's arithmetic gives one canonical NaN)."""
    import cupy as cp

    rng = np.random.default_rng(5)
    T = 9
    x = _tie_free(rng, T, E, dtype)
    # NaN bit patterns written straight into the array: quiet and signaling, either sign, with payloads
    if dtype == BF16:
        bits, xb = np.array([0x7FC0, 0xFFC0, 0x7F81, 0xFFBF, 0x7FC5, 0xFF83], np.uint16), x.view(np.uint16)
    else:
        bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FC12345, 0xFF812345], np.uint32)
        xb = x.view(np.uint32)
    for t in range(1, T):  # row 0 keeps no NaN; row t has 3t NaNs at random places, the last row only NaNs
        cols = rng.choice(E, size=min(t * 3, E), replace=False)
        xb[t, cols] = bits[rng.integers(0, len(bits), cols.size)]
    xb[T - 1, :] = bits[rng.integers(0, len(bits), E)]
    assert np.isnan(x.astype(F32)).sum() == sum(min(3 * t, E) for t in range(1, T - 1)) + E
    bias = (rng.permutation(E) * (0.1 / E)).astype(F32)
    kw_g = dict(num_groups=groups[0], group_topk=groups[1]) if groups else {}
    for score in ("softmax", "sigmoid", "sqrtsoftplus"):
        for use_bias in ((False, True) if score != "softmax" else (False,)):
            kw = dict(kw_g, score_function=score)
            gp, gm, _ = R.topk_with_score(cp.asarray(x), K, expert_bias=cp.asarray(bias) if use_bias else None, **kw)
            rp, rm, _ = R.topk_with_score(x, K, expert_bias=bias if use_bias else None, **kw)
            np.testing.assert_array_equal(gm.get(), rm, err_msg=f"{score} bias={use_bias}")
            assert (gm.get().sum(axis=1) == K).all()
            np.testing.assert_array_equal(np.isnan(gp.get().astype(F32)), np.isnan(rp.astype(F32)))


@pytest.mark.gpu
def test_gpu_torch_and_unaligned(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    x = torch.tensor(_tie_free(rng, 65, 257, F32)).cuda()
    xs = x[:, 1:]  # non-contiguous -> copied; E=256
    p, m, i = R.topk_with_score(xs, 8, score_function="sigmoid")
    rp, rm, _ = ref.topk_with_score_fwd(xs.cpu().numpy(), 8, score_function="sigmoid")
    assert isinstance(p, torch.Tensor) and p.is_cuda
    np.testing.assert_array_equal(m.cpu().numpy(), rm)
    flat = torch.tensor(_tie_free(rng, 1, 65 * 256 + 1, F32)).cuda()[0, 1:].view(65, 256)  # 4-byte aligned
    p2, m2, _ = R.topk_with_score(flat, 8)
    rp2, rm2, _ = ref.topk_with_score_fwd(flat.cpu().numpy(), 8)
    np.testing.assert_array_equal(m2.cpu().numpy(), rm2)
    _close(p2.cpu().numpy(), rp2, F32, 256, "probs unaligned")


# Short rows (at most 16 chunks of 16 bytes, no groups, k <= 8) run router_fwd_reg on segments of W = 4, 8 or 16
# lanes, 32 / W tokens a warp. Launched here directly beside the kernel of one warp a token that such rows took
# before (8 keys a lane), on the same inputs (ties, NaNs, all-equal rows; token counts that leave a warp's
# last segments past the end), every output poisoned first: the same bytes.
def _launch_fwd_reg(cp, name, x, K, spb, smem_words, *, score, pre=0, aux=0, scale=1.0, bias=None, bitmap=False,
                    idx=False):
    from moe_rt import _jit

    T, E = x.shape
    _jit.register("router.cu", [name])
    fn = _jit.function("router.cu", name)
    poison = np.array(np.nan, F32).astype(x.dtype)
    probs = None if aux or idx else cp.full((T, E), poison, dtype=x.dtype)
    scores = cp.full((T, E), np.nan, dtype=F32) if aux else None
    rmap = None if idx else (cp.full((T, (E + 7) // 8), 0xAB, dtype=np.uint8) if bitmap
                             else cp.full((T, E), 0x7F, dtype=np.uint8))
    inter = None if idx else cp.full((T, E), np.nan, dtype=F32)
    topk_idx = cp.full((T, K), -7, dtype=np.int32) if idx else None
    topk_w = cp.full((T, K), np.nan, dtype=F32) if idx else None
    code = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}[score]
    args = (x, np.int64(T), np.int32(E), np.int32(K), np.int32(code), np.int32(pre), np.int32(aux), np.int32(0),
            np.int32(0), np.int32(0), np.uint32(0), np.float32(scale), bias, probs, scores, rmap, inter, topk_idx,
            topk_w, np.int32(1), np.int32(0), np.int32(4))
    _jit.launch(fn, (max(1, -(-T // (2 * spb))),), 128, args, shared_mem=4 * smem_words * spb)
    return [a.get() for a in (probs, scores, rmap, inter, topk_idx, topk_w) if a is not None]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,E,K", [(F32, 8, 2), (F32, 16, 5), (F32, 32, 4), (F32, 60, 6), (F32, 64, 8),
                                       (BF16, 8, 1), (BF16, 32, 8), (BF16, 64, 8), (BF16, 128, 8), (BF16, 80, 3)])
def test_gpu_short_row_segments_give_the_bits_of_a_warp_a_token(rng, dtype, E, K):
    import cupy as cp

    ct, ch = ("float", 4) if dtype == F32 else ("__nv_bfloat16", 8)
    W = 4
    while W < E // ch or W < K:
        W *= 2
    kp = -(-K // 4) * 4
    # the kernels such rows took before: 8 keys a lane (bf16: compiled without groups)
    one_warp = {(F32, False): "router_fwd_reg<float, 8>", (F32, True): "router_fwd_reg<float, 8, true, false, true>",
                (BF16, False): "router_fwd_reg<__nv_bfloat16, 8, false>",
                (BF16, True): "router_fwd_reg<__nv_bfloat16, 8, false, false, true>"}
    for T in (1, 37, 4099):
        xh = rng.standard_normal((T, E)).astype(F32)
        xh[::3] = np.round(xh[::3] * 2) / 2  # exact ties
        xh[1::7, 0] = np.nan
        xh[0] = 0.25  # a row of equal logits
        clean = ~np.isnan(xh).any(1)
        x = cp.asarray(xh.astype(dtype))
        bias = cp.asarray((rng.permutation(E) * (0.5 / E)).astype(F32))
        modes = [dict(score="softmax"), dict(score="softmax", pre=1, scale=1.5), dict(score="sigmoid", bias=bias),
                 dict(score="sqrtsoftplus", scale=2.0), dict(score="sigmoid"), dict(score="softmax", aux=1),
                 dict(score="sigmoid", aux=1), dict(score="sqrtsoftplus", aux=1),
                 dict(score="softmax", bitmap=True), dict(score="sigmoid", bias=bias, bitmap=True),
                 dict(score="softmax", idx=True), dict(score="sigmoid", bias=bias, idx=True, scale=2.0)]
        for kw in modes:
            bm = "true" if kw.get("bitmap") else "false"
            seg = _launch_fwd_reg(cp, f"router_fwd_reg<{ct}, {ch}, false, false, {bm}, -1, {W}>", x, K, 4 * (32 // W),
                                  4 * kp, **kw)
            warp = _launch_fwd_reg(cp, one_warp[dtype, bool(kw.get("bitmap"))], x, K, 4,
                                   16 * 32 + 2 * 64 + 4 + 4 * kp, **kw)
            for a, b in zip(seg, warp):
                assert a.shape == b.shape
                assert (np.ascontiguousarray(a).view(np.uint8) == np.ascontiguousarray(b).view(np.uint8)).all(), \
                    (T, kw, a.dtype)
            if not kw.get("aux") and not kw.get("idx"):  # every probs and map element written
                assert not np.isnan(seg[0][clean].astype(F32)).any(), (T, kw)
                if not kw.get("bitmap"):
                    assert np.isin(seg[1], (0, 1)).all() and (seg[1].sum(1) == K).all(), (T, kw)
            if kw.get("idx"):
                assert (seg[0] >= 0).all() and (seg[0] < E).all(), (T, kw)


# Long rows with exact ties at the selection boundary: logits rounded to steps of 1/s. Coarse steps leave
# more than 64 keys at or above the prefilter's threshold (the radix select then runs on the whole row);
# finer steps leave a short list with a few ties at the k-th key, which must still go by lowest index.
@pytest.mark.gpu
@pytest.mark.parametrize("E,K", [(2304, 36), (2304, 64), (16384, 8), (4096, 17)])
@pytest.mark.parametrize("s", [4, 64, 4096])
def test_gpu_long_rows_ties_exact(rng, E, K, s):
    import cupy as cp

    x = (np.round(rng.standard_normal((129, E)) * s) / s).astype(F32)
    x[0] = 0.5  # one row of all-equal logits: the first K experts
    probs, rmap, inter = (a.get() for a in R.topk_with_score(cp.asarray(x), K))
    rp, rm, ri = ref.topk_with_score_fwd(x, K)
    np.testing.assert_array_equal(rmap, rm)
    assert rmap[0, :K].all() and rmap.sum(1).tolist() == [K] * len(x)
    _close(probs, rp, F32, E, "probs")
    _close(inter, ri, F32, E, "intermediate")


# Grouped top-k on long rows (E = 2304, 8 groups, top-4 groups, K = 36: m = 9 keys a group score) whose
# groups hold c equal top keys, c from 1 to the whole group, so that in one warp the group candidate lists
# take each path: fp32, sorted in registers (at most 32 keys), ranked in shared memory (at most 51); bf16
# (lists from the chunk maxima), sorted 4 keys a lane (at most 16) or 8 (at most 28); both, too long (the
# radix select of each group's segment of lanes). The selected groups' least m-th key bounds the top-k
# prefilter. Other keys: a tie-free grid below the top value, so group scores that differ do so by far more
# than rounding.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_group_lists_with_equal_keys(rng, dtype, bias):
    import cupy as cp

    T, E, G, K = 130, 2304, 8, 36
    n = E // G
    x = _tie_free(rng, T, E, F32) * 0.75 - 1.0
    counts = [1, 5, 8, 9, 12, 20, 31, 32, 33, 40, 51, 52, 60, 100, n]
    for t in range(T):
        for j in range(G):
            c = counts[(t + 5 * j) % len(counts)]
            x[t, j * n + rng.choice(n, c, replace=False)] = 3.0
    x = x.astype(dtype)
    # a bias constant per group keeps the equal keys equal
    b = np.repeat(np.arange(G, dtype=F32)[::-1] * 2.0 ** -10, n) if bias else None
    kw = dict(score_function="sigmoid", num_groups=G, group_topk=4, expert_bias=b)
    a = cp.empty(16 * T * E, dtype=cp.uint8)
    a.fill(0xFF)  # poisons the pool the outputs come from
    del a
    probs, rmap, inter = (v.get() for v in R.topk_with_score(cp.asarray(x), K, **dict(
        kw, expert_bias=None if b is None else cp.asarray(b))))
    rp, rm, ri = ref.topk_with_score_fwd(x, K, **kw)
    np.testing.assert_array_equal(rmap, rm)
    assert (rmap.sum(1) == K).all()
    _close(probs, rp, dtype, E, "probs")
    _close(inter, ri, F32, E, "intermediate")


# (T, E, K, dtype, score): the top-k backward on 16-byte rows (post-softmax, sigmoid, sqrtsoftplus), whose
# kernels read only the selected entries of grad and intermediate: grads that are NaN / inf off the routing map
# (never read, and not in the result), the memory pool poisoned before the call so an unwritten element shows.
SEL_BWD_CASES = [(7, 8, 1, F32, "softmax"), (517, 8, 2, BF16, "sigmoid"), (517, 256, 8, F32, "softmax"),
                 (517, 256, 8, BF16, "sigmoid"), (517, 256, 1, np.float16, "sqrtsoftplus"),
                 (333, 2304, 36, F32, "sigmoid"), (333, 2304, 36, BF16, "softmax"),
                 (65, 16384, 64, F32, "sqrtsoftplus"), (65, 16384, 8, BF16, "softmax"),
                 # dense selections: threads with more selected entries than the kernel keeps in registers
                 (517, 256, 64, F32, "sigmoid"), (517, 64, 16, BF16, "softmax"), (97, 1024, 64, F32, "softmax"),
                 (129, 2304, 64, BF16, "sigmoid", dict(num_groups=8, group_topk=1)),
                 (129, 2304, 64, F32, "softmax", dict(num_groups=32, group_topk=1))]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SEL_BWD_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-K{c[2]}-{np.dtype(c[3]).name}-{c[4]}{'-g' if len(c) > 5 else ''}")
def test_gpu_topk_backward_selected_entries_only(rng, case):
    import cupy as cp

    T, E, K, dtype, score = case[:5]
    kw = case[5] if len(case) > 5 else {}
    x = _tie_free(rng, T, E, dtype)
    _, rmap, inter = R.topk_with_score(cp.asarray(x), K, score_function=score, scaling_factor=1.5, **kw)
    gy = rng.standard_normal((T, E)).astype(F32)
    off = ~rmap.get()
    gy[off & (rng.random((T, E)) < 0.5)] = np.nan
    gy[off & (rng.random((T, E)) < 0.1)] = np.inf
    gy = cp.asarray(gy.astype(dtype))

    def run():
        a = cp.empty(8 * T * E * 4, dtype=cp.uint8)
        a.fill(0xFF)
        del a
        return R.topk_with_score_backward(gy, rmap, inter, K, score_function=score, scaling_factor=1.5).get()

    got = run()
    assert got.tobytes() == run().tobytes()  # reproducible
    assert np.isfinite(got.astype(F32)).all() and (got[off] == 0).all()
    rdx = ref.topk_with_score_bwd(gy.get(), rmap.get(), inter.get(), K, False, 1.5, score)
    scale_row = np.abs(rdx.astype(F32)).max(1, keepdims=True) + 1e-30
    np.testing.assert_allclose(got.astype(F32) / scale_row, rdx.astype(F32) / scale_row,
                               atol=1e-5 if dtype == F32 else 2 ** -7)
