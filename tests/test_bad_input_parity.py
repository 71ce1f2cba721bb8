"""Bad input is refused the same way by every front end that reaches an op on the CPU: the core ops on NumPy
arrays (the reference backend) and on CPU torch tensors, ``moe_rt.torch`` and ``moe_rt.jax`` (and TE's names,
``moe_rt.te`` / ``moe_rt.te_jax``). Each case calls one op with one bad argument on every front end and
checks the exception is the same type (TypeError or ValueError, never an AttributeError, IndexError, a raw
JAX runtime error or no error) and names the argument. CPU only."""
import re
from types import SimpleNamespace

import numpy as np
import pytest

import moe_rt

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy
mt = pytest.importorskip("moe_rt.torch")
mj = pytest.importorskip("moe_rt.jax")
te = pytest.importorskip("moe_rt.te")
tj = pytest.importorskip("moe_rt.te_jax")

T, E, K, H = 7, 8, 2, 16
F32 = np.float32


def _data():
    rng = np.random.default_rng(11)
    idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
    rmap = np.zeros((T, E), bool)
    np.put_along_axis(rmap, idx, True, axis=1)
    return SimpleNamespace(logits=rng.standard_normal((T, E)).astype(F32), idx=idx, map=rmap,
                           x=rng.standard_normal((T, H)).astype(F32), probs=rng.random((T, K)).astype(F32),
                           tpe=np.full(E, 3, np.int32))


D = _data()


def _torch(a):
    return torch.from_numpy(np.ascontiguousarray(a))


# name -> (ops, array converter, is this a core-op front end)
FRONT_ENDS = {"numpy": (moe_rt, lambda a: a, True), "core+torch": (moe_rt, _torch, True),
              "torch": (mt, _torch, False), "jax": (mj, jnp.asarray, False)}
ALL = tuple(FRONT_ENDS)
CORE = ("numpy", "core+torch")


def _qb(ops, A, **kw):
    args = dict(expert_bias=A(np.zeros(E, F32)), qb_histogram=A(np.zeros((E, 4), np.int32)),
                qb_bin_bounds=A(np.array([-1, 1], F32)))
    args.update(kw)
    return lambda: ops.topk_with_score_qb(A(D.logits), K, **args)


def _sort(ops, A, core, split, order, probs=None, x=None):
    x = A(D.x) if x is None else x
    if core:
        return lambda: ops.sort_chunks(x, split, order, probs=probs)
    return lambda: ops.sort_chunks(x, split, order, probs)


def _plan_call(fn):
    """``fn(ops, A, core, plan)``: a case given its front end's plan of the routing ``D.idx``."""
    return lambda ops, A, core: fn(ops, A, core, ops.make_plan(A(D.idx), E))


def _fp8(fn):
    def build(ops, A, core):
        q, s = ops.quantize_fp8(A(D.x), 8)
        return fn(ops, A, core, q, s)
    return build


# (id, exception, the argument its message names, build(ops, A, core) -> the bad call, front ends)
CASES = [
    # -- an array argument that is None, or no array (fixed: AttributeError / 'no array argument' / a jnp
    #    ValueError / a list taken by moe_rt.jax)
    ("topk logits None", TypeError, "logits", lambda o, A, c: lambda: o.topk_with_score(None, K), ALL),
    ("topk logits list", TypeError, "logits", lambda o, A, c: lambda: o.topk_with_score(D.logits.tolist(), K), ALL),
    ("topk expert_bias list", TypeError, "expert_bias",
     lambda o, A, c: lambda: o.topk_with_score(A(D.logits), K, score_function="sigmoid", expert_bias=[0.0] * E), ALL),
    ("scores logits None", TypeError, "logits", lambda o, A, c: lambda: o.scores_for_aux_loss(None, K, "softmax"),
     ALL),
    ("aux_loss probs None", TypeError, "probs", lambda o, A, c: lambda: o.aux_loss(None, A(D.tpe), T, E, K, 0.1), ALL),
    ("aux_loss tokens_per_expert list", TypeError, "tokens_per_expert",
     lambda o, A, c: lambda: o.aux_loss(A(D.logits), D.tpe.tolist(), T, E, K, 0.1), ALL),
    ("make_plan routing None", TypeError, "routing", lambda o, A, c: lambda: o.make_plan(None, E), ALL),
    ("make_plan routing list", TypeError, "routing", lambda o, A, c: lambda: o.make_plan(D.idx.tolist(), E), ALL),
    ("dispatch x None", TypeError, "x", _plan_call(lambda o, A, c, p: lambda: o.dispatch(None, p)), ALL),
    ("dispatch probs list", TypeError, "probs",
     _plan_call(lambda o, A, c, p: lambda: o.dispatch(A(D.x), p, D.probs.tolist())), ALL),
    ("combine y_permuted None", TypeError, "y_permuted",
     _plan_call(lambda o, A, c, p: lambda: o.combine(None, p, A(D.probs))), ALL),
    ("sort_chunks x None", TypeError, "x",
     lambda o, A, c: lambda: o.sort_chunks(None, [3, 4], [1, 0]), ALL),
    ("sort_chunks x list", TypeError, "x", lambda o, A, c: _sort(o, A, c, [3, 4], [1, 0], x=D.x.tolist()), ALL),
    ("sort_chunks split_sizes None", TypeError, "split_sizes", lambda o, A, c: _sort(o, A, c, None, [1, 0]), ALL),
    ("quantize x None", TypeError, "x", lambda o, A, c: lambda: o.quantize_fp8(None, 8), ALL),
    ("quantize x list", TypeError, "x", lambda o, A, c: lambda: o.quantize_fp8(D.x.tolist(), 8), ALL),
    ("dequantize x_fp8 None", TypeError, "x_fp8",
     _fp8(lambda o, A, c, q, s: lambda: o.dequantize_fp8(None, s, block=8)), ALL),
    ("dequantize scales None", TypeError, "scales",
     _fp8(lambda o, A, c, q, s: lambda: o.dequantize_fp8(q, None, block=8)), ALL),
    # -- Quantile Balancing's required arrays given as None (fixed: ValueError on the core and moe_rt.jax,
    #    TypeError on moe_rt.torch)
    ("qb expert_bias None", TypeError, "expert_bias", lambda o, A, c: _qb(o, A, expert_bias=None), ALL),
    ("qb qb_histogram None", TypeError, "qb_histogram", lambda o, A, c: _qb(o, A, qb_histogram=None), ALL),
    ("qb qb_bin_bounds None", TypeError, "qb_bin_bounds", lambda o, A, c: _qb(o, A, qb_bin_bounds=None), ALL),
    # -- values of a CPU routing / chunk order (fixed: a JaxRuntimeError from moe_rt.jax's callback; an
    #    IndexError, a NumPy broadcast error or no error from CPU torch index tensors)
    ("make_plan id E", ValueError, "routing",
     lambda o, A, c: lambda: o.make_plan(A(np.where(D.idx == D.idx[3, 1], E, D.idx).astype(np.int32)), E), ALL),
    ("make_plan id -2", ValueError, "routing",
     lambda o, A, c: lambda: o.make_plan(A(np.where(D.idx == D.idx[2, 0], -2, D.idx).astype(np.int32)), E), ALL),
    ("sort_chunks negative size", ValueError, "split_sizes",
     lambda o, A, c: _sort(o, A, c, A(np.array([3, -1, 5], np.int32)), A(np.array([2, 0, 1], np.int32))), ALL),
    ("sort_chunks sizes over N", ValueError, "split_sizes",
     lambda o, A, c: _sort(o, A, c, A(np.array([3, 2, 9], np.int32)), A(np.array([2, 0, 1], np.int32))), ALL),
    ("sort_chunks repeated index", ValueError, "sorted_indices",
     lambda o, A, c: _sort(o, A, c, A(np.array([3, 2, 2], np.int32)), A(np.array([0, 0, 1], np.int32))), ALL),
    ("sort_chunks index out of range", ValueError, "sorted_indices",
     lambda o, A, c: _sort(o, A, c, A(np.array([3, 2, 2], np.int32)), A(np.array([0, 1, 5], np.int32))), ALL),
    ("sort_chunks index count", ValueError, "sorted_indices",
     lambda o, A, c: _sort(o, A, c, A(np.array([3, 2, 2], np.int32)), A(np.array([0, 1], np.int32))), ALL),
    ("sort_chunks 2-D split_sizes", ValueError, "split_sizes",
     lambda o, A, c: _sort(o, A, c, A(np.array([[3, 2, 2]], np.int32)), A(np.array([2, 0, 1], np.int32))), ALL),
    ("sort_chunks probs int8", TypeError, "probs",
     lambda o, A, c: _sort(o, A, c, [3, 2, 2], [2, 0, 1], probs=A(np.zeros(T, np.int8))), ALL),
    # -- a representative set of the rest (one semantics already)
    ("topk logits int8", TypeError, "logits", lambda o, A, c: lambda: o.topk_with_score(A(D.logits.astype(np.int8)), K),
     ALL),
    ("topk logits 1-D", ValueError, "logits", lambda o, A, c: lambda: o.topk_with_score(A(D.logits[0]), K), ALL),
    ("topk topk=0", ValueError, "topk", lambda o, A, c: lambda: o.topk_with_score(A(D.logits), 0), ALL),
    ("topk topk>E", ValueError, "topk", lambda o, A, c: lambda: o.topk_with_score(A(D.logits), E + 1), ALL),
    ("topk topk float", TypeError, "topk", lambda o, A, c: lambda: o.topk_with_score(A(D.logits), 2.0), ALL),
    ("topk topk bool", TypeError, "topk", lambda o, A, c: lambda: o.topk_with_score(A(D.logits), True), ALL),
    ("topk score_function", ValueError, "score_function",
     lambda o, A, c: lambda: o.topk_with_score(A(D.logits), K, score_function="relu"), ALL),
    ("topk routing_map_format", ValueError, "routing_map_format",
     lambda o, A, c: lambda: o.topk_with_score(A(D.logits), K, routing_map_format="bits"), ALL),
    ("topk num_groups", ValueError, "num_groups",
     lambda o, A, c: lambda: o.topk_with_score(A(D.logits), K, num_groups=3, group_topk=1), ALL),
    ("topk group_topk", ValueError, "group_topk",
     lambda o, A, c: lambda: o.topk_with_score(A(D.logits), K, num_groups=4, group_topk=5), ALL),
    ("qb qb_histogram_mode", ValueError, "qb_histogram_mode",
     lambda o, A, c: _qb(o, A, qb_histogram_mode="atomic"), ALL),
    ("qb qb_histogram dtype", TypeError, "qb_histogram",
     lambda o, A, c: _qb(o, A, qb_histogram=A(np.zeros((E, 4), F32))), ALL),
    ("scores topk", ValueError, "topk", lambda o, A, c: lambda: o.scores_for_aux_loss(A(D.logits), 0, "softmax"), ALL),
    ("aux_loss num_experts", ValueError, "num_experts",
     lambda o, A, c: lambda: o.aux_loss(A(D.logits), A(D.tpe), T, 3, K, 0.1), ALL),
    ("aux_loss coeff", ValueError, "coeff",
     lambda o, A, c: lambda: o.aux_loss(A(D.logits), A(D.tpe), T, E, K, float("nan")), ALL),
    # -- a float setting finite in float64 but not in float32, which the ops compute in (fixed: inf probs and
    #    loss, with no error)
    ("topk scaling_factor over float32", ValueError, "scaling_factor",
     lambda o, A, c: lambda: o.topk_with_score(A(D.logits), K, scaling_factor=1e39), ALL),
    ("topk scaling_factor under -float32", ValueError, "scaling_factor",
     lambda o, A, c: lambda: o.topk_with_score(A(D.logits), K, scaling_factor=-3.5e38), ALL),
    ("qb scaling_factor over float32", ValueError, "scaling_factor",
     lambda o, A, c: _qb(o, A, scaling_factor=1e39), ALL),
    ("aux_loss coeff over float32", ValueError, "coeff",
     lambda o, A, c: lambda: o.aux_loss(A(D.logits), A(D.tpe), T, E, K, 1e300), ALL),
    ("make_plan routing float", TypeError, "routing", lambda o, A, c: lambda: o.make_plan(A(D.idx.astype(F32)), E),
     ALL),
    ("make_plan align_size", ValueError, "align_size", lambda o, A, c: lambda: o.make_plan(A(D.idx), E, align_size=-4),
     ALL),
    ("make_plan num_out_tokens", ValueError, "num_out_tokens",
     lambda o, A, c: lambda: o.make_plan(A(D.idx), E, num_out_tokens=-1), ALL),
    ("dispatch x rows", ValueError, "x", _plan_call(lambda o, A, c, p: lambda: o.dispatch(A(D.x[:-1]), p)), ALL),
    ("dispatch probs dtype", TypeError, "probs",
     _plan_call(lambda o, A, c, p: lambda: o.dispatch(A(D.x), p, A(D.probs.astype(np.int8)))), ALL),
    ("combine y_permuted rows", ValueError, "y_permuted",
     _plan_call(lambda o, A, c, p: lambda: o.combine(A(np.zeros((p.num_rows - 1, H), F32)), p)), ALL),
    ("quantize block", ValueError, "block", lambda o, A, c: lambda: o.quantize_fp8(A(D.x), 0), ALL),
    ("dequantize scales shape", ValueError, "scales",
     _fp8(lambda o, A, c, q, s: lambda: o.dequantize_fp8(q, A(np.ones((T, 3), F32)), block=8)), ALL),
    # -- backward ops of the core (fixed: tokens_per_expert None was an AttributeError)
    ("aux_loss_backward tokens_per_expert None", TypeError, "tokens_per_expert",
     lambda o, A, c: lambda: o.aux_loss_backward(A(np.array(1.0, F32)), T, None, T, E, K, 0.1), CORE),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_front_end_raises_the_same_error(case):
    _, exc, arg, build, front_ends = case
    got = {}
    for name in front_ends:
        ops, A, core = FRONT_ENDS[name]
        call = build(ops, A, core)
        try:
            call()
        except Exception as e:  # noqa: BLE001 - any exception is recorded, then judged below
            got[name] = e
        else:
            got[name] = None
    for name, err in got.items():
        assert type(err) is exc, f"{name}: expected {exc.__name__} naming {arg}, got {err!r}"
        assert re.search(rf"(?<![\w.]){re.escape(arg)}\b", str(err)), f"{name}: {arg} not named in {err}"


# -- TE's names: moe_rt.te (torch) and moe_rt.te_jax -----------------------------------------------------

TE_CASES = [
    ("te permute inp None", TypeError, "inp", lambda: te.moe_permute(None, _torch(D.map), T * K),
     lambda: tj.token_dispatch(None, jnp.asarray(D.map), T * K)),
    ("te permute inp list", TypeError, "inp", lambda: te.moe_permute(D.x.tolist(), _torch(D.map), T * K),
     lambda: tj.token_dispatch(D.x.tolist(), jnp.asarray(D.map), T * K)),
    ("te permute routing_map None", TypeError, "routing_map", lambda: te.moe_permute(_torch(D.x), None, T * K),
     lambda: tj.token_dispatch(jnp.asarray(D.x), None, T * K)),
    ("te aux probs None", TypeError, "probs", lambda: te.fused_moe_aux_loss(None, _torch(D.tpe), T, E, K, 0.1),
     lambda: tj.fused_moe_aux_loss(None, jnp.asarray(D.tpe), K, 0.1)),
    ("te sort inp None", TypeError, "inp",
     lambda: te.moe_sort_chunks_by_index(None, _torch(np.array([3, 4], np.int32)), _torch(np.array([1, 0], np.int32))),
     lambda: tj.sort_chunks_by_index(None, jnp.asarray([3, 4]), jnp.asarray([1, 0]))),
    ("te sort negative size", ValueError, "split_sizes",
     lambda: te.moe_sort_chunks_by_index(_torch(D.x), _torch(np.array([3, -1], np.int32)),
                                         _torch(np.array([1, 0], np.int32))),
     lambda: tj.sort_chunks_by_index(jnp.asarray(D.x), jnp.asarray([3, -1]), jnp.asarray([1, 0]))),
    ("te topk score_function", ValueError, "score_function",
     lambda: te.fused_topk_with_score_function(_torch(D.logits), K, False, None, None, None, "relu", None),
     lambda: tj.fused_topk_with_score_function(jnp.asarray(D.logits), K, score_function="relu")),
    ("te topk topk", ValueError, "topk",
     lambda: te.fused_topk_with_score_function(_torch(D.logits), 0, False, None, None, None, "softmax", None),
     lambda: tj.fused_topk_with_score_function(jnp.asarray(D.logits), 0)),
]


@pytest.mark.parametrize("case", TE_CASES, ids=[c[0] for c in TE_CASES])
def test_te_front_ends_raise_the_same_error(case):
    _, exc, arg, torch_call, jax_call = case
    for name, call in (("te", torch_call), ("te_jax", jax_call)):
        with pytest.raises(Exception) as e:
            call()
        assert type(e.value) is exc, f"{name}: expected {exc.__name__} naming {arg}, got {e.value!r}"
        assert re.search(rf"(?<![\w.]){re.escape(arg)}\b", str(e.value)), f"{name}: {arg} not named in {e.value}"


def test_core_ops_never_write_into_jax_arrays():
    """The core ops that write a caller's array in place refuse a JAX array (immutable) with a TypeError, as
    they refuse a read-only NumPy one, and leave it as it was: JAX's DLPack view of its buffer is writable, and
    the histogram was accumulated into it and the bias, bounds and histogram overwritten, on every backend."""
    rng = np.random.default_rng(5)
    hist = jnp.asarray(rng.integers(0, 5, (E, 4)).astype(np.int32))
    bounds, bias = jnp.asarray(np.array([-1, 1], F32)), jnp.asarray(rng.standard_normal(E).astype(F32))
    before = [np.array(a) for a in (hist, bounds, bias)]
    logits = jnp.asarray(D.logits)
    with pytest.raises(TypeError, match="qb_histogram: a read-only array"):
        moe_rt.topk_with_score_qb(logits, K, score_function="sigmoid", expert_bias=bias, qb_histogram=hist,
                                  qb_bin_bounds=bounds)
    with pytest.raises(TypeError, match="qb_histogram: a read-only array"):
        moe_rt.qb_histogram_accumulate(jnp.asarray(rng.random((T, E)).astype(F32)), jnp.zeros(T, F32), bounds, hist)
    for name, args in (("qb_histogram", (hist, np.array(before[1]), np.array(before[2]))),
                       ("qb_bin_bounds", (np.array(before[0]), bounds, np.array(before[2]))),
                       ("expert_bias", (np.array(before[0]), np.array(before[1]), bias))):
        with pytest.raises(TypeError, match=f"{name}: a read-only array"):
            moe_rt.update_expert_bias_with_quantile(*args, K)
    for a, b in zip((hist, bounds, bias), before):
        np.testing.assert_array_equal(np.array(a), b)
