"""The TransformerEngine-parity features of the core ops and both adapters, against the NumPy reference:
make_plan's map_type (no silent reading of an integer 0/1 map as expert ids), permuted probs in the probs'
dtype (fp32 on request), aux_loss with a device total_num_tokens, and sort_chunks with autograd in
moe_rt.torch (eager and torch.compile) and moe_rt.jax. CPU tensors and arrays here; GPU-marked twins run
the kernels."""
import numpy as np
import pytest

import moe_rt
from moe_rt import permutation as P
from moe_rt.reference import permutation as RP
from moe_rt.reference import router as RR

BF16 = pytest.importorskip("ml_dtypes").bfloat16
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _map(rng, T, E, K):
    """A 0/1 routing map with K distinct experts per token, every few tokens routed fewer."""
    m = np.zeros((T, E), np.int32)
    for t in range(T):
        m[t, rng.choice(E, size=K if t % 4 else max(K - 1, 1), replace=False)] = 1
    return m


class _To:
    """``asarray`` onto the device: NumPy on the CPU, torch CUDA tensors on the GPU (bf16 included)."""

    def __init__(self, device):
        self.device = device

    def asarray(self, a):
        a = np.asarray(a)
        if self.device == "cpu":
            return a
        import torch

        if a.dtype == BF16:
            return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).cuda()
        return torch.from_numpy(a.copy()).cuda()


def _xp(device):
    return _To(device)


# -- make_plan map_type ----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_int_map_is_not_read_as_ids(rng, device):
    xp = _xp(device)
    T, E = 384, 5
    m = _map(rng, T, E, 2)
    with pytest.raises(ValueError, match="map_type"):
        P.make_plan(xp.asarray(m), E)
    plan = P.make_plan(xp.asarray(m), E, map_type="mask", num_out_tokens=int(m.sum()))
    ref = RP.make_plan(RP.routing_map_to_topk(m.astype(bool)), E, 1, int(m.sum()))
    for k in ("counts", "dst_row", "src_slot", "seg_start"):
        np.testing.assert_array_equal(_np(getattr(plan, k)), ref[k])
    np.testing.assert_array_equal(_np(plan.counts), m.sum(0))
    # the same map as bool gives the same plan
    pb = P.make_plan(xp.asarray(m.astype(bool)), E, num_out_tokens=int(m.sum()))
    np.testing.assert_array_equal(_np(pb.dst_row), _np(plan.dst_row))


@pytest.mark.parametrize("device", DEVICES)
def test_index_with_topk_equal_experts_needs_map_type(rng, device):
    xp = _xp(device)
    T, E = 50, 4
    idx = np.stack([rng.permutation(E) for _ in range(T)]).astype(np.int32)
    idx[::3, 1] = -1
    with pytest.raises(ValueError, match="map_type"):
        P.make_plan(xp.asarray(idx), E)
    plan = P.make_plan(xp.asarray(idx), E, map_type="index")
    ref = RP.make_plan(idx, E)
    np.testing.assert_array_equal(_np(plan.dst_row), ref["dst_row"])
    # K != E stays unambiguous (no keyword needed)
    P.make_plan(xp.asarray(idx[:, :3]), E)


def test_map_type_bad_input():
    m = np.zeros((4, 3), bool)
    with pytest.raises(ValueError, match="map_type"):
        P.make_plan(m, 3, map_type="dense")
    with pytest.raises(TypeError, match="index"):
        P.make_plan(m, 3, map_type="index")
    with pytest.raises(ValueError, match="num_experts=4"):
        P.make_plan(np.zeros((4, 3), np.int32), 4, map_type="mask")
    with pytest.raises(TypeError, match="routing map"):
        P.make_plan(np.zeros((4, 3), np.float32), 3, map_type="mask")


def test_map_type_torch_and_jax(rng):
    torch = pytest.importorskip("torch")
    import moe_rt.torch as mt

    T, E = 40, 6
    m = _map(rng, T, E, 3)
    n = int(m.sum())
    ref = RP.make_plan(RP.routing_map_to_topk(m.astype(bool)), E, 1, n)
    with pytest.raises(ValueError, match="map_type"):
        mt.make_plan(torch.from_numpy(m), E)
    tp = mt.make_plan(torch.from_numpy(m), E, map_type="mask", num_out_tokens=n)
    np.testing.assert_array_equal(tp.dst_row.numpy(), ref["dst_row"])
    f = torch.compile(lambda r: mt.make_plan(r, E, map_type="mask", num_out_tokens=n), fullgraph=True)
    np.testing.assert_array_equal(f(torch.from_numpy(m)).dst_row.numpy(), ref["dst_row"])
    with pytest.raises(TypeError, match="index"):
        mt.make_plan(torch.from_numpy(m.astype(bool)), E, map_type="index")

    jax = pytest.importorskip("jax")
    import moe_rt.jax as mj

    with pytest.raises(ValueError, match="map_type"):
        mj.make_plan(jax.numpy.asarray(m), E)
    jp = jax.jit(lambda r: mj.make_plan(r, E, map_type="mask", num_out_tokens=n))(jax.numpy.asarray(m))
    np.testing.assert_array_equal(np.asarray(jp.dst_row), ref["dst_row"])


# -- permuted probs in the probs' dtype ------------------------------------------------------------------

def _np(a):
    if hasattr(a, "get"):
        return a.get()
    if type(a).__module__.startswith("torch"):
        a = a.cpu()
        return a.view(__import__("torch").int16).numpy().view(np.uint16) if str(a.dtype) == "torch.bfloat16" else a.numpy()
    return np.asarray(a)


PROB_DTYPES = [np.float32, np.float16, BF16, np.float64]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pdt", PROB_DTYPES)
@pytest.mark.parametrize("dense", [False, True])
def test_dispatch_probs_dtype(rng, device, pdt, dense):
    xp = _xp(device)
    T, E, K, H, A = 53, 7, 3, 24, 4
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    idx[::6, 0] = -1
    probs = (rng.random((T, E) if dense else (T, K)) + 0.05).astype(pdt)
    x = rng.standard_normal((T, H)).astype(np.float32)
    plan = P.make_plan(xp.asarray(idx), E, align_size=A)
    ref = RP.make_plan(idx, E, A)
    slot = np.take_along_axis(probs.astype(np.float64), np.maximum(idx, 0), 1) if dense else probs
    slot = np.where(idx >= 0, slot, 0).astype(pdt) if dense else slot
    _, exp = RP.dispatch(x, ref, slot.astype(np.float64 if pdt == np.float64 else np.float32), probs_dtype=pdt)
    _, pp = P.dispatch(xp.asarray(x), plan, xp.asarray(probs))
    assert _np(pp).dtype.itemsize == np.dtype(pdt).itemsize
    np.testing.assert_array_equal(_bits(_np(pp)), _bits(exp))
    # exact copies of the given probs
    rows = ref["dst_row"][idx >= 0]
    np.testing.assert_array_equal(_bits(exp[rows]), _bits(slot[idx >= 0].astype(pdt)))
    _, p32 = P.dispatch(xp.asarray(x), plan, xp.asarray(probs.astype(np.float32)), probs_dtype="float32")
    _, p32b = P.dispatch(xp.asarray(x), plan, xp.asarray(probs), probs_dtype="float32")
    assert _np(p32b).dtype == np.float32
    np.testing.assert_array_equal(_np(p32b), exp.astype(np.float32))
    if pdt != np.float64:  # fp32 holds fp16/bf16 exactly: the same values as fp32 probs give
        np.testing.assert_array_equal(_np(p32), _np(p32b))


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def test_dispatch_probs_dtype_bad():
    plan = P.make_plan(np.zeros((3, 2), np.int32), 4)
    with pytest.raises(ValueError, match="probs_dtype"):
        P.dispatch(np.zeros((3, 4), np.float32), plan, np.ones((3, 2), np.float32), probs_dtype="float16")


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_probs_dtype_adapters(rng, device):
    torch = pytest.importorskip("torch")
    import moe_rt.torch as mt

    T, E, K, H = 31, 5, 2, 16
    idx = torch.from_numpy(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32))
    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(device).requires_grad_()
    probs = torch.from_numpy(rng.random((T, K)).astype(np.float32) + 0.1).to(device, torch.bfloat16).requires_grad_()
    plan = mt.make_plan(idx.to(device), E)
    ref = RP.make_plan(idx.numpy(), E)
    for fn in (mt.dispatch, torch.compile(mt.dispatch, fullgraph=True)):
        _, pp = fn(x, plan, probs)
        assert pp.dtype == torch.bfloat16
        exp = RP.dispatch(x.detach().cpu().numpy(), ref, probs.detach().float().cpu().numpy(), probs_dtype=BF16)[1]
        np.testing.assert_array_equal(_np(pp), exp.view(np.uint16))
        gpp = torch.from_numpy(rng.standard_normal(pp.shape[0]).astype(np.float32)).to(device, torch.bfloat16)
        (gp,) = torch.autograd.grad(pp, probs, gpp)
        assert gp.dtype == torch.bfloat16
        dst = torch.from_numpy(ref["dst_row"]).long().to(device)
        torch.testing.assert_close(gp, gpp[dst], rtol=0, atol=0)
        _, p32 = (lambda: fn(x, plan, probs, probs_dtype=torch.float32))() if fn is mt.dispatch else \
            torch.compile(lambda a, b: mt.dispatch(a, plan, b, probs_dtype="float32"), fullgraph=True)(x, probs)
        assert p32.dtype == torch.float32
        torch.testing.assert_close(p32, pp.float(), rtol=0, atol=0)

    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import moe_rt.jax as mj

    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    jx = jax.device_put(jnp.asarray(x.detach().cpu().numpy()), dev)
    jp = jax.device_put(jnp.asarray(probs.detach().float().cpu().numpy()).astype(jnp.bfloat16), dev)
    jplan = mj.make_plan(jax.device_put(jnp.asarray(idx.numpy()), dev), E)
    _, pp = jax.jit(lambda a, b: mj.dispatch(a, jplan, b))(jx, jp)
    assert pp.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(pp).view(np.uint16), exp.view(np.uint16))
    _, p32 = mj.dispatch(jx, jplan, jp, probs_dtype="float32")
    assert p32.dtype == jnp.float32
    g = jax.grad(lambda b: (mj.dispatch(jx, jplan, b)[1].astype(jnp.float32) * jnp.arange(T * K)).sum())(jp)
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.arange(T * K, dtype=np.float32)[ref["dst_row"]]
                                  .astype(BF16).astype(np.float32))


# -- aux_loss with a device total_num_tokens -------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tdt", [np.int64, np.int32])
def test_aux_loss_device_total(rng, device, tdt):
    xp = _xp(device)
    R, E, B, k, coeff = 97, 12, 2, 3, 0.013
    probs = rng.random((R, B * E)).astype(np.float32)
    tpe = rng.integers(1, 50, B * E).astype(np.int32)
    for T in (97, 2048, 8175):
        exp = RR.aux_loss_fwd(probs, tpe, T, E, k, coeff)
        got = moe_rt.aux_loss(xp.asarray(probs), xp.asarray(tpe), xp.asarray(np.array(T, tdt)), E, k, coeff)
        host = moe_rt.aux_loss(xp.asarray(probs), xp.asarray(tpe), T, E, k, coeff)
        assert _np(got).tobytes() == _np(host).tobytes()  # the same coefficient bits either way
        if device == "cpu":
            assert _np(got).tobytes() == np.asarray(exp).tobytes()
        g = moe_rt.aux_loss_backward(xp.asarray(np.float32(1.5)), R, xp.asarray(tpe), xp.asarray(np.array([T], tdt)),
                                     E, k, coeff)
        np.testing.assert_array_equal(_np(g), RR.aux_loss_bwd(np.float32(1.5), R, tpe, T, E, k, coeff))
    with pytest.raises(TypeError, match="total_num_tokens"):
        moe_rt.aux_loss(xp.asarray(probs), xp.asarray(tpe), xp.asarray(np.array(5.0)), E, k, coeff)
    with pytest.raises(ValueError, match="total_num_tokens"):
        moe_rt.aux_loss(xp.asarray(probs), xp.asarray(tpe), xp.asarray(np.array([5, 6])), E, k, coeff)


def test_aux_loss_device_total_reference():
    # unchecked like TE: T = 0 gives inf, on every backend
    probs = np.ones((2, 4), np.float32)
    out = moe_rt.aux_loss(probs, np.ones(4, np.int32), np.array(0), 4, 1, 0.1)
    assert np.isinf(out)


@pytest.mark.parametrize("device", DEVICES)
def test_aux_loss_device_total_adapters(rng, device):
    torch = pytest.importorskip("torch")
    import moe_rt.torch as mt

    R, E, k, coeff = 64, 8, 2, 0.01
    probs = torch.from_numpy(rng.random((R, E)).astype(np.float32)).to(device)
    tpe = torch.from_numpy(rng.integers(1, 40, E).astype(np.int32)).to(device)
    T = torch.tensor(1000, dtype=torch.int64, device=device)
    f = torch.compile(lambda p, t: mt.aux_loss(p, tpe, t, E, k, coeff), fullgraph=True)
    for fn in (lambda p, t: mt.aux_loss(p, tpe, t, E, k, coeff), f):
        for n in (1000, 517):
            T.fill_(n)
            p = probs.clone().requires_grad_()
            loss = fn(p, T)
            (g,) = torch.autograd.grad(loss, p)
            exp = RR.aux_loss_fwd(probs.cpu().numpy(), tpe.cpu().numpy(), n, E, k, coeff)
            assert loss.item() == pytest.approx(float(exp), rel=1e-6)
            np.testing.assert_array_equal(g.cpu().numpy(), RR.aux_loss_bwd(np.float32(1), R, tpe.cpu().numpy(), n,
                                                                           E, k, coeff))

    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import moe_rt.jax as mj

    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    jpr = jax.device_put(jnp.asarray(probs.cpu().numpy()), dev)
    jt = jax.device_put(jnp.asarray(tpe.cpu().numpy()), dev)
    step = jax.jit(jax.value_and_grad(lambda p, t: mj.aux_loss(p, jt, t, E, k, coeff)))
    for n in (1000, 517):
        loss, g = step(jpr, jnp.asarray(n, jnp.int32))
        assert float(loss) == pytest.approx(float(RR.aux_loss_fwd(np.asarray(jpr), np.asarray(jt), n, E, k, coeff)),
                                            rel=1e-6)
        np.testing.assert_array_equal(np.asarray(g), RR.aux_loss_bwd(np.float32(1), R, np.asarray(jt), n, E, k, coeff))


# -- sort_chunks in the adapters -------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_probs", [False, True])
def test_sort_chunks_torch(rng, device, with_probs):
    torch = pytest.importorskip("torch")
    import moe_rt.torch as mt

    N, H = 61, 10
    split = [7, 0, 19, 11, 20]  # 57 rows in chunks, 4 stay in place
    order = [3, 0, 4, 2, 1]
    x = torch.from_numpy(rng.standard_normal((N, H)).astype(np.float32)).to(device, torch.bfloat16)
    probs = torch.from_numpy(rng.random(N).astype(np.float32)).to(device, torch.bfloat16) if with_probs else None
    exp, exp_p = RP.sort_chunks(x.float().cpu().numpy(), split, order,
                                None if probs is None else probs.float().cpu().numpy())
    gy = torch.from_numpy(rng.standard_normal((N, H)).astype(np.float32)).to(device, torch.bfloat16)
    gpo = torch.from_numpy(rng.standard_normal(N).astype(np.float32)).to(device)
    exp_gx = RP.sort_chunks_backward(gy.float().cpu().numpy(), split, order)[0]
    s_t = torch.tensor(split, dtype=torch.int32, device=device)
    o_t = torch.tensor(order, dtype=torch.int64, device=device)
    compiled = torch.compile(lambda a, b, s, o: mt.sort_chunks(a, s, o, probs=b), fullgraph=True)
    for name, fn in (("eager-list", lambda a, b: mt.sort_chunks(a, split, order, probs=b)),
                     ("eager-tensor", lambda a, b: mt.sort_chunks(a, s_t, o_t, probs=b)),
                     ("compiled", lambda a, b: compiled(a, b, s_t, o_t))):
        xa = x.clone().requires_grad_()
        pa = None if probs is None else probs.clone().requires_grad_()
        r = fn(xa, pa)
        out = r[0] if with_probs else r
        np.testing.assert_array_equal(out.detach().float().cpu().numpy(), exp, err_msg=name)
        if with_probs:
            assert r[1].dtype == torch.float32
            np.testing.assert_array_equal(r[1].detach().cpu().numpy(), exp_p)
            gx, gp = torch.autograd.grad([out, r[1]], [xa, pa], [gy, gpo])
            assert gp.dtype == torch.bfloat16
            np.testing.assert_array_equal(gp.float().cpu().numpy(), RP.sort_chunks_backward(
                gy.float().cpu().numpy(), split, order, gpo.cpu().numpy())[1].astype(BF16).astype(np.float32))
        else:
            (gx,) = torch.autograd.grad(out, xa, gy)
        np.testing.assert_array_equal(gx.float().cpu().numpy(), exp_gx, err_msg=name)
    with pytest.raises(ValueError, match="sorted_indices"):
        mt.sort_chunks(x, split, [0, 0, 1, 2, 3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_probs", [False, True])
def test_sort_chunks_jax(rng, device, with_probs):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import moe_rt.jax as mj

    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    N, H = 45, 6
    split, order = [5, 17, 0, 20], [2, 3, 1, 0]
    x = jax.device_put(jnp.asarray(rng.standard_normal((N, H)).astype(np.float32)), dev)
    p = jax.device_put(jnp.asarray(rng.random(N).astype(np.float32)), dev) if with_probs else None
    exp, exp_p = RP.sort_chunks(np.asarray(x), split, order, None if p is None else np.asarray(p))
    w = jnp.asarray(rng.standard_normal((N, H)).astype(np.float32))
    wp = jnp.asarray(rng.standard_normal(N).astype(np.float32))

    def loss(a, b, s, o):
        r = mj.sort_chunks(a, s, o, probs=b)
        return (r[0] * w).sum() + (r[1] * wp).sum() if with_probs else (r * w).sum()

    for s, o in ((split, order), (jnp.asarray(split), jnp.asarray(order))):
        r = jax.jit(lambda a, b, s=s, o=o: mj.sort_chunks(a, s, o, probs=b))(x, p)
        np.testing.assert_array_equal(np.asarray(r[0] if with_probs else r), exp)
        if with_probs:
            np.testing.assert_array_equal(np.asarray(r[1]), exp_p)
        grads = jax.grad(lambda a, b: loss(a, b, s, o), argnums=(0, 1) if with_probs else 0)(x, p)
        gx = grads[0] if with_probs else grads
        np.testing.assert_array_equal(np.asarray(gx), RP.sort_chunks_backward(np.asarray(w), split, order)[0])
        if with_probs:
            np.testing.assert_array_equal(np.asarray(grads[1]),
                                          RP.sort_chunks_backward(np.asarray(w), split, order, np.asarray(wp))[1])
    with pytest.raises(ValueError, match="split_sizes"):
        mj.sort_chunks(x, [50, 1, 0, 0], order)


# -- the new keywords through the ops' checkers (the JAX adapter checks them when it traces) ------------

def test_checkers_take_the_new_keywords():
    from moe_rt import router as R

    r = np.zeros((5, 3), np.int8)
    assert P.check_plan_settings(3, 1, None, "mask") == (3, 1, None)
    with pytest.raises(ValueError, match="map_type"):
        P.check_plan_settings(3, 1, None, "dense")
    assert P.check_routing(r, 3, 1, None, "mask") == (5, 3, True, 15)
    with pytest.raises(TypeError, match="routing map"):
        P.check_routing(r.astype(np.float32), 3, 1, None, "mask")
    with pytest.raises(ValueError, match="map_type='mask' or map_type='index'"):
        P.check_routing(r.astype(np.int32), 3, 1, None)
    assert P.check_routing(r.astype(np.int32), 3, 1, None, "index")[:3] == (5, 3, False)
    x, pr = np.zeros((5, 4), np.float32), np.zeros((5, 3), np.float16)
    assert P.check_dispatch_args(x, pr, 5, 3, 3) == np.float16
    assert P.check_dispatch_args(x, pr, 5, 3, 3, "float32") == np.float32
    assert P.check_dispatch_args(x, None, 5, 3, 3) is None
    with pytest.raises(ValueError, match="probs_dtype"):
        P.check_dispatch_args(x, pr, 5, 3, 3, "bfloat16")
    p, tpe = np.zeros((5, 3), np.float32), np.zeros(3, np.int32)
    for total in (7, np.array(7, np.int32), np.array([7], np.int64)):
        assert R.check_aux_loss_args(p, tpe, total, 3, 2, 0.5) == (5, 3, 0.5)
    for bad, err in ((7.0, TypeError), ("7", TypeError), (True, TypeError), (0, ValueError),
                     (np.array(7.0), TypeError), (np.array([7, 7], np.int32), ValueError)):
        with pytest.raises(err, match="total_num_tokens"):
            R.check_aux_loss_args(p, tpe, bad, 3, 2, 0.5)
        with pytest.raises(err, match="total_num_tokens"):
            R.aux_loss(p, tpe, bad, 3, 2, 0.5)


def test_jax_new_keywords_checked_when_traced():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import moe_rt.jax as mj

    calls = []
    real = P.make_plan

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    r = jnp.zeros((5, 3), jnp.int32)
    P.make_plan = spy  # a trace-time error must come before any core call
    try:
        with pytest.raises(ValueError, match="map_type"):
            jax.jit(lambda a: mj.make_plan(a, 3, map_type="dense").arrays)(r)
        with pytest.raises(ValueError, match="map_type='mask' or map_type='index'"):
            jax.jit(lambda a: mj.make_plan(a, 3).arrays)(r)
        with pytest.raises(TypeError, match="routing map"):
            jax.jit(lambda a: mj.make_plan(a, 3, map_type="mask").arrays)(r.astype(jnp.float32))
    finally:
        P.make_plan = real
    assert not calls
    plan = mj.make_plan(jnp.zeros((5, 2), jnp.int32), 3)
    x, pr = jnp.zeros((5, 4), jnp.float32), jnp.zeros((5, 2), jnp.float32)
    with pytest.raises(ValueError, match="probs_dtype"):
        jax.jit(lambda a, b: mj.dispatch(a, plan, b, probs_dtype="float16"))(x, pr)
    p, tpe = jnp.zeros((5, 3), jnp.float32), jnp.zeros(3, jnp.int32)
    with pytest.raises(TypeError, match="total_num_tokens"):
        jax.jit(lambda a, t: mj.aux_loss(a, tpe, t, 3, 2, 0.5))(p, jnp.float32(7))
    with pytest.raises(ValueError, match="total_num_tokens"):
        jax.jit(lambda a, t: mj.aux_loss(a, tpe, t, 3, 2, 0.5))(p, jnp.zeros(2, jnp.int32))
    with pytest.raises(TypeError, match="total_num_tokens"):
        mj.aux_loss(p, tpe, 7.0, 3, 2, 0.5)


def test_torch_func_grad_through_the_new_ops(rng):
    """torch.func.grad through dispatch(probs_dtype=...), sort_chunks and aux_loss with a device
    total_num_tokens equals eager autograd; torch.vmap is refused with the ops' NotImplementedError."""
    torch = pytest.importorskip("torch")
    import moe_rt.torch as mt

    T, E, K, H = 7, 5, 2, 3
    idx = torch.from_numpy(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32))
    plan = mt.make_plan(idx, E)
    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32))
    p = torch.from_numpy(rng.random((T, K)))  # float64 probs, permuted as float32
    w = torch.from_numpy(rng.standard_normal(T * K).astype(np.float32))

    def eager_vs_func(f, *args):
        g = torch.func.grad(f, argnums=tuple(range(len(args))))(*args)
        leaves = [a.clone().requires_grad_() for a in args]
        f(*leaves).backward()
        for a, b in zip(g, leaves):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a.numpy(), b.grad.numpy())

    def disp(x, p):
        xp, pp = mt.dispatch(x, plan, p, probs_dtype="float32")
        assert pp.dtype == torch.float32
        return (xp.sum(1) * pp * w).sum()

    eager_vs_func(disp, x, p)
    s, o = [3, 4], [1, 0]
    pv = torch.from_numpy(rng.random(T).astype(np.float32))

    def sort(x, pv):
        out, po = mt.sort_chunks(x, s, o, probs=pv)
        return (out.sum(1) * po * w[:T]).sum()

    eager_vs_func(sort, x, pv)
    pr = torch.from_numpy(rng.random((9, E)).astype(np.float32))
    tpe = torch.from_numpy(rng.integers(0, 9, E).astype(np.int64))
    total = torch.tensor(9, dtype=torch.int32)
    eager_vs_func(lambda q: mt.aux_loss(q, tpe, total, E, K, 0.3), pr)
    with pytest.raises(NotImplementedError, match="vmap"):
        torch.vmap(lambda a: mt.sort_chunks(a, s, o))(x[None].repeat(2, 1, 1))
    with pytest.raises(NotImplementedError, match="vmap"):
        torch.vmap(lambda q: mt.aux_loss(q, tpe, total, E, K, 0.3))(pr[None].repeat(2, 1, 1))
