"""FP8: the e4m3 block quantization (docs/fp8.md) against ml_dtypes and an independent implementation, the
NumPy/torch/JAX CPU paths, FP8 dispatch with scales, bad input (always run), and the CUDA kernels and CUDA
FP8 dispatch bit for bit against the reference (``-m gpu``)."""
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import moe_rt
from moe_rt.reference import fp8 as RF
from moe_rt.reference import permutation as RP

try:
    import torch

    import moe_rt.torch  # noqa: F401 - moe_rt.torch.*
except ImportError:  # pragma: no cover
    torch = None
try:
    import jax
    import jax.numpy as jnp

    import moe_rt.jax  # noqa: F401 - moe_rt.jax.*
except ImportError:  # pragma: no cover
    jax = jnp = None

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), BF16, np.dtype(np.float16)]


# -- an independent implementation (ml_dtypes' cast after clipping, float max for amax) ------------------

def independent_quantize(x, block):
    x32 = np.asarray(x).astype(np.float32)
    T, H = x32.shape
    nb = -(-H // block)
    scales = np.empty((T, nb), np.float32)
    q = np.empty((T, H), E4M3)
    for b in range(nb):
        blk = x32[:, b * block:(b + 1) * block]
        amax = np.abs(blk).max(axis=1) if blk.shape[1] else np.zeros(T, np.float32)
        s = (amax / np.float32(448.0)).astype(np.float32)
        s[s == 0] = np.float32(1.0)
        scales[:, b] = s
        quot = (blk / s[:, None]).astype(np.float32)
        # ml_dtypes rounds to nearest even but does not saturate: clip first (same result for |v| >= 448)
        q[:, b * block:(b + 1) * block] = np.clip(quot, -448.0, 448.0).astype(E4M3)
    return q, scales


def independent_dequantize(q, scales, dtype, block):
    H = q.shape[1]
    s = np.repeat(scales, block, axis=1)[:, :H]
    with np.errstate(over="ignore"):  # fp16 overflows to inf, as the op does
        return (q.astype(np.float32) * s).astype(np.float32).astype(dtype)


def e4m3_values():
    """Every finite e4m3 value, ascending (non-negative)."""
    v = np.arange(0, 0x7F, dtype=np.uint8).view(E4M3).astype(np.float32)
    return np.sort(v)


def edge_inputs(rng, T, H, dtype, block):
    """Fresh random rows with hard cases: zero rows and blocks, blocks of subnormals of ``dtype``, values far
    past 448, huge and tiny magnitudes, and blocks whose scale is a power of two holding exact e4m3 ties."""
    dtype = np.dtype(dtype)
    x = rng.standard_normal((T, H)).astype(np.float32)
    x *= np.exp2(rng.integers(-8, 12, (T, 1))).astype(np.float32)
    nb = -(-H // block)
    tiny = {np.dtype(np.float32): 1e-40, BF16: 1e-39, np.dtype(np.float16): 3e-6}[dtype]
    big = {np.dtype(np.float32): 1e30, BF16: 1e30, np.dtype(np.float16): 6e4}[dtype]
    vals = e4m3_values()
    mids = ((vals[1:] + vals[:-1]) / 2).astype(np.float32)  # exact midpoints: round-to-even ties
    for t in range(T):
        kind = t % 7
        b = int(rng.integers(0, nb))
        lo, hi = b * block, min((b + 1) * block, H)
        n = hi - lo
        if kind == 0:
            x[t] = 0
        elif kind == 1:
            x[t, lo:hi] = 0
            if n > 1:
                x[t, lo] = -0.0
        elif kind == 2:
            x[t, lo:hi] = rng.uniform(-1, 1, n).astype(np.float32) * np.float32(tiny)
        elif kind == 3:
            x[t, lo:hi] *= np.float32(big / max(np.abs(x[t, lo:hi]).max(), 1e-30))
        elif kind == 4 and n >= 2:
            k = int(rng.integers(-6, 4))
            x[t, lo:hi] = rng.choice(mids, n) * np.float32(2.0 ** k) * rng.choice([-1, 1], n).astype(np.float32)
            x[t, lo] = np.float32(448.0 * 2.0 ** k)  # amax: the scale is exactly 2^k
        elif kind == 5:
            x[t, lo:hi] = rng.uniform(-1, 1, n).astype(np.float32) * np.float32(2.0 ** -150)
        # kind 6: plain random row
    return x.astype(dtype)


def bits(a):
    return np.asarray(a).view(np.uint8) if np.dtype(np.asarray(a).dtype).itemsize == 1 else \
        np.asarray(a).view(np.uint16 if np.asarray(a).dtype.itemsize == 2 else np.uint32)


# -- the rounding itself ----------------------------------------------------------------------------------

def test_e4m3_rounding_against_ml_dtypes(rng):
    raw = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    raw = raw[np.isfinite(raw)]
    scaled = (rng.standard_normal(400_000) * np.exp2(rng.integers(-16, 12, 400_000))).astype(np.float32)
    vals = e4m3_values()
    mids = ((vals[1:] + vals[:-1]) / 2).astype(np.float32)
    near = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf)), vals])
    v = np.concatenate([raw, scaled, near, -near, [0.0, -0.0]]).astype(np.float32)
    v = v[np.isfinite(v)]
    got = RF.f32_to_e4m3_bits(v)
    ref = v.astype(E4M3).view(np.uint8)
    inr = np.abs(v) < 464  # 464 is the tie between 448 and the (NaN) code above: beyond it ml_dtypes gives NaN
    np.testing.assert_array_equal(got[inr], ref[inr])
    sign = ((v.view(np.uint32) >> 31) << 7).astype(np.uint8)
    np.testing.assert_array_equal(got[~inr], (0x7E | sign)[~inr])
    assert RF.f32_to_e4m3_bits(np.float32([np.inf, -np.inf, 464, 1e38])).tolist() == [0x7E, 0xFE, 0x7E, 0x7E]
    assert RF.f32_to_e4m3_bits(np.float32([np.nan]))[0] & 0x7F == 0x7F


def test_bit_helpers_against_numpy(rng):
    """The reference's own conversions (computed on bits, so that a flush-to-zero floating-point mode, as in
    a JAX CPU callback, cannot change them) against NumPy's and ml_dtypes' casts."""
    v64 = np.concatenate([rng.standard_normal(50_000) * np.exp2(rng.integers(-160, 130, 50_000)),
                          np.exp2(np.arange(-151.0, -120.0)) * 1.5, [0.0, -0.0, 2.0 ** -150, 3 * 2.0 ** -150]])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(RF.f64_to_f32_bits(v64), v64.astype(np.float32).view(np.uint32))
    b32 = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    b32 = b32[np.isfinite(b32.view(np.float32))]
    f32 = b32.view(np.float32)
    np.testing.assert_array_equal(RF.f32_bits_to_f64(b32), f32.astype(np.float64))
    np.testing.assert_array_equal(RF.f32_bits_to_bf16_bits(b32), f32.astype(BF16).view(np.uint16))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(RF.f32_bits_to_f16_bits(b32), f32.astype(np.float16).view(np.uint16))
    h = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = h[np.isfinite(h)]
    np.testing.assert_array_equal(RF._f32_bits(h), h.astype(np.float32).view(np.uint32))


def test_e4m3_decode_every_code():
    codes = np.arange(256, dtype=np.uint8)
    got = RF.e4m3_bits_to_f32(codes)
    ref = codes.view(E4M3).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan) and nan.sum() == 2
    np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    np.testing.assert_array_equal(RF.f32_to_e4m3_bits(got[~nan]), codes[~nan])


# -- the reference op against the independent implementation -------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("T,H,block", [(29, 7168, 128), (17, 300, 128), (9, 130, 64), (12, 7, 128), (7, 96, 32),
                                       (5, 45, 7), (0, 256, 128), (3, 0, 128)])
def test_quantize_reference(rng, dtype, T, H, block):
    x = edge_inputs(rng, T, H, dtype, block) if T and H else np.zeros((T, H), dtype)
    q, s = moe_rt.quantize_fp8(x, block)
    assert q.dtype == E4M3 and s.dtype == np.float32
    assert q.shape == (T, H) and s.shape == (T, -(-H // block))
    qi, si = independent_quantize(x, block)
    np.testing.assert_array_equal(bits(s), bits(si))
    np.testing.assert_array_equal(bits(q), bits(qi))
    for out in (np.float32, BF16, np.float16):
        y = moe_rt.dequantize_fp8(q, s, out, block)
        assert y.dtype == np.dtype(out)
        np.testing.assert_array_equal(bits(y), bits(independent_dequantize(q, s, out, block)))
    if T and H:
        # round trip within e4m3's precision: half an ulp (2^-4 relative) or half the smallest step
        y = moe_rt.dequantize_fp8(q, s, np.float32, block)
        x32 = x.astype(np.float32)
        step = np.repeat(s, block, axis=1)[:, :H]
        err = np.abs(y - x32)
        ok = (err <= np.abs(x32) * 2.0 ** -4 * 1.0001 + step * 2.0 ** -10 * 1.0001) | (np.abs(x32) < 2.0 ** -140)
        assert ok.all()


def test_scale_rule_cases():
    x = np.zeros((4, 256), np.float32)
    x[1, :128] = 448.0 * 2.0 ** -3
    x[1, 5] = -3.0
    x[2, 128] = np.float32(2.0 ** -149)  # amax / 448 underflows: scale 1
    x[3, 0] = np.float32(1e-41)  # subnormal amax, subnormal scale kept
    q, s = moe_rt.quantize_fp8(x)
    assert s[0].tolist() == [1.0, 1.0] and not q[0].view(np.uint8).any()
    assert s[1, 0] == np.float32(2.0 ** -3) and q[1, 0].astype(np.float32) == 448.0
    assert q[1, 5].astype(np.float32) == -24.0
    assert s[2, 1] == 1.0 and q[2, 128].view(np.uint8) == 0
    assert s[3, 0] == np.float32(1e-41) / np.float32(448) and s[3, 0] != 0
    assert q[3, 0].astype(np.float32) == 448.0
    assert moe_rt.dequantize_fp8(q, s, np.float32)[3, 0] == np.float32(448) * s[3, 0]


# -- frameworks on the CPU ------------------------------------------------------------------------------

@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_torch_cpu(rng):
    x = edge_inputs(rng, 13, 384, np.float32, 128)
    q, s = moe_rt.quantize_fp8(x)
    xt = torch.from_numpy(x).to(torch.bfloat16)
    qr, sr = moe_rt.quantize_fp8(xt.float().numpy().astype(BF16))
    for f in (moe_rt.quantize_fp8, moe_rt.torch.quantize_fp8):
        qt, st = f(xt)
        assert qt.dtype == torch.float8_e4m3fn and st.dtype == torch.float32
        np.testing.assert_array_equal(qt.view(torch.uint8).numpy(), bits(qr))
        np.testing.assert_array_equal(st.numpy(), sr)
    for f in (moe_rt.dequantize_fp8, moe_rt.torch.dequantize_fp8):
        y = f(qt, st, torch.float16)
        assert y.dtype == torch.float16
        np.testing.assert_array_equal(y.view(torch.int16).numpy(),
                                      bits(moe_rt.dequantize_fp8(qr, sr, np.float16)).view(np.int16))
    qc, sc = torch.compile(moe_rt.torch.quantize_fp8, fullgraph=True)(xt)
    assert torch.equal(qc.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(sc, st)
    q2, _ = moe_rt.torch.quantize_fp8(xt.clone().requires_grad_())
    assert not q2.requires_grad


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_torch_compile_recompiles(rng):
    """The compiled quantize/dequantize ops compile once per dtype and block, not once per call: the same
    shape never recompiles, and token counts past the first two share one graph (T stays symbolic)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    cc = CompileCounter()
    fq = torch.compile(moe_rt.torch.quantize_fp8, backend=cc, fullgraph=True)
    fd = torch.compile(moe_rt.torch.dequantize_fp8, backend=cc, fullgraph=True)
    counts = []
    for T in (13, 13, 17, 19, 23, 31):
        x = edge_inputs(rng, T, 200, BF16, 64)
        qr, sr = moe_rt.quantize_fp8(x, 64)
        xt = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
        for _ in range(2):
            q, s = fq(xt, 64)
            assert q.dtype == torch.float8_e4m3fn and q.shape == (T, 200)
            np.testing.assert_array_equal(q.view(torch.uint8).numpy(), bits(qr))
            np.testing.assert_array_equal(s.numpy().view(np.uint32), sr.view(np.uint32))
            y = fd(q, s, torch.float16, 64)
            np.testing.assert_array_equal(y.view(torch.int16).numpy(),
                                          bits(moe_rt.dequantize_fp8(qr, sr, np.float16, 64)).view(np.int16))
        counts.append(cc.frame_count)
    # T=13: one graph each; T=17: one more each (Dynamo then marks T dynamic); later T: none
    assert counts == [2, 2, 4, 4, 4, 4], counts
    torch._dynamo.reset()


@pytest.mark.skipif(jax is None, reason="jax not installed")
def test_jax_cpu(rng):
    x = edge_inputs(rng, 11, 200, BF16, 128)
    qr, sr = moe_rt.quantize_fp8(x)
    xj = jnp.asarray(x)
    for f in (moe_rt.quantize_fp8, moe_rt.jax.quantize_fp8, jax.jit(moe_rt.jax.quantize_fp8)):
        q, s = f(xj)
        assert q.dtype == jnp.float8_e4m3fn
        np.testing.assert_array_equal(bits(np.asarray(q)), bits(qr))
        np.testing.assert_array_equal(np.asarray(s), sr)
    y = jax.jit(lambda a, b: moe_rt.jax.dequantize_fp8(a, b, jnp.float32))(q, s)
    np.testing.assert_array_equal(np.asarray(y), moe_rt.dequantize_fp8(qr, sr, np.float32))
    assert moe_rt.dequantize_fp8(q, s, jnp.bfloat16).dtype == jnp.bfloat16


# -- FP8 dispatch on the CPU ----------------------------------------------------------------------------

def _routing(rng, T, E, K):
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    idx[rng.random((T, K)) < 0.1] = -1
    return idx


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=lambda d: d.name)
def test_cpu_fp8_dispatch(rng, fp8):
    T, E, K, H = 37, 6, 3, 200
    idx = _routing(rng, T, E, K)
    raw = rng.integers(0, 256, (T, H), dtype=np.uint8)
    scales = rng.random((T, 2), dtype=np.float32) + 0.5
    probs = rng.random((T, K), dtype=np.float32)
    plan = moe_rt.make_plan(idx, E, align_size=8)
    ref_x, _ = RP.dispatch(raw, plan._dict())
    ref_s, _ = RP.dispatch(scales, plan._dict())
    x = raw.view(fp8)
    out, _ = moe_rt.dispatch(x, plan)
    assert out.dtype == fp8
    np.testing.assert_array_equal(bits(out), ref_x)
    xp, sp, pp = moe_rt.dispatch_fp8(x, scales, plan, probs)
    np.testing.assert_array_equal(bits(xp), ref_x)
    np.testing.assert_array_equal(sp, ref_s)
    np.testing.assert_array_equal(pp, moe_rt.dispatch(scales, plan, probs)[1])
    unused = np.asarray(plan.src_slot) < 0
    assert unused.any() and not sp[unused].any() and not bits(xp)[unused].any()
    if torch is not None:
        tdt = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}[fp8]
        tplan = moe_rt.make_plan(torch.from_numpy(idx), E, align_size=8)
        xt = torch.from_numpy(raw).view(tdt)
        xpt, spt, _ = moe_rt.dispatch_fp8(xt, torch.from_numpy(scales), tplan)
        assert xpt.dtype == tdt
        np.testing.assert_array_equal(xpt.view(torch.uint8).numpy(), ref_x)
        np.testing.assert_array_equal(spt.numpy(), ref_s)
        xnc = torch.from_numpy(np.ascontiguousarray(np.repeat(raw, 2, axis=1))).view(tdt)[:, ::2]  # strided
        np.testing.assert_array_equal(moe_rt.dispatch(xnc, tplan)[0].view(torch.uint8).numpy(), ref_x)
        tp = moe_rt.torch.make_plan(torch.from_numpy(idx), E, align_size=8)
        pr = torch.from_numpy(probs).requires_grad_()
        xpa, ppa = moe_rt.torch.dispatch(xt, tp, pr)
        np.testing.assert_array_equal(xpa.view(torch.uint8).numpy(), ref_x)
        ppa.sum().backward()  # the probs' gradient alone; FP8 rows have none
        np.testing.assert_array_equal(pr.grad.numpy(), (idx >= 0).astype(np.float32))
    if jax is not None:
        jplan = moe_rt.jax.make_plan(jnp.asarray(idx), E, align_size=8)
        xj = jax.lax.bitcast_convert_type(jnp.asarray(raw), fp8)
        for o in (moe_rt.jax.dispatch(xj, jplan)[0], jax.jit(lambda a: moe_rt.jax.dispatch(a, jplan)[0])(xj),
                  moe_rt.dispatch(xj, moe_rt.make_plan(jnp.asarray(idx), E, align_size=8))[0]):
            assert o.dtype == fp8
            np.testing.assert_array_equal(bits(np.asarray(o)), ref_x)


def _callbacks(jaxpr):
    """Every buffer_callback equation in ``jaxpr`` and the jaxprs nested in its equations' parameters, and
    every op that lowers per platform (an XLA FFI custom call on CUDA, a buffer_callback elsewhere: its FP8
    bytes are checked when the callback runs)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("buffer_callback", "moe_rt_per_platform"):
            found.append(eqn)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _callbacks(inner)
    return found


@pytest.mark.skipif(jax is None, reason="jax not installed")
def test_jax_fp8_crosses_callbacks_as_uint8(rng, monkeypatch):
    """XLA's GPU buffers of an FP8 type offer no __cuda_array_interface__: every moe_rt.jax op taking or
    giving FP8 passes those bytes into and out of its buffer_callback as uint8 (a bitcast in the traced
    program), while the op inside still sees the FP8 dtype (bit-identical results; combine refuses FP8)."""
    T, E, K, H, block = 29, 5, 2, 70, 32
    idx = _routing(rng, T, E, K)
    x = edge_inputs(rng, T, H, BF16, block)
    raw = rng.integers(0, 256, (T, H), dtype=np.uint8)
    probs = rng.random((T, K), dtype=np.float32)
    qr, sr = moe_rt.quantize_fp8(x, block)
    cplan = moe_rt.make_plan(idx, E, align_size=4)
    ref_x, ref_p = RP.dispatch(raw, cplan._dict(), probs)
    split = rng.multinomial(T, np.ones(4) / 4).astype(np.int32)
    order = rng.permutation(4).astype(np.int32)
    ref_sc, _ = RP.sort_chunks(raw, split, order)
    jplan = moe_rt.jax.make_plan(jnp.asarray(idx), E, align_size=4)
    fp8 = {E4M3: jnp.float8_e4m3fn, E5M2: jnp.float8_e5m2}

    # what the callbacks receive and must give, seen when each runs (eager and under jit)
    seen = []
    real = moe_rt.jax.buffer_callback

    def watching(callback, result_specs, **kw):
        def cb(ctx, outs, *ins):
            seen.append(tuple(np.dtype(b.dtype) for b in ins) + tuple(np.dtype(o.dtype) for o in outs))
            return callback(ctx, outs, *ins)
        return real(cb, result_specs, **kw)

    monkeypatch.setattr(moe_rt.jax, "buffer_callback", watching)

    progs = {
        "quantize": (lambda a: moe_rt.jax.quantize_fp8(a, block), (jnp.asarray(x),)),
        "dequantize": (lambda q, s: moe_rt.jax.dequantize_fp8(q, s, jnp.float32, block),
                       (jnp.asarray(qr), jnp.asarray(sr))),
    }
    for dt, jdt in fp8.items():
        xj = jax.lax.bitcast_convert_type(jnp.asarray(raw), jdt)
        progs[f"dispatch {dt.name}"] = (lambda a, p: moe_rt.jax.dispatch(a, jplan, p), (xj, jnp.asarray(probs)))
        progs[f"sort_chunks {dt.name}"] = (lambda a: moe_rt.jax.sort_chunks(a, split, order), (xj,))
        # the backward pass: FP8 cotangents of sort_chunks' rows go back through a callback too
        progs[f"sort_chunks vjp {dt.name}"] = (
            lambda a: jax.vjp(lambda b: moe_rt.jax.sort_chunks(b, split, order), a)[1](a)[0], (xj,))
    for name, (f, args) in progs.items():
        jaxpr = jax.make_jaxpr(f)(*args).jaxpr
        cbs = _callbacks(jaxpr)
        assert cbs, name
        callbacks = [eqn for eqn in cbs if eqn.primitive.name == "buffer_callback"]
        for eqn in callbacks:
            dts = [np.dtype(v.aval.dtype) for v in eqn.invars] + [np.dtype(a.dtype) for a in eqn.params["result_avals"]]
            assert not any(d in (E4M3, E5M2) for d in dts), (name, dts)
        if callbacks:
            assert "bitcast_convert_type" in str(jaxpr), name
        seen.clear()
        for run in (f, jax.jit(f)):
            out = run(*args)
            assert seen and not any(d in (E4M3, E5M2) for ent in seen for d in ent), (name, seen)
            seen.clear()
            if name == "quantize":
                assert out[0].dtype == jnp.float8_e4m3fn
                np.testing.assert_array_equal(bits(np.asarray(out[0])), bits(qr))
                np.testing.assert_array_equal(np.asarray(out[1]), sr)
            elif name == "dequantize":
                np.testing.assert_array_equal(np.asarray(out), moe_rt.dequantize_fp8(qr, sr, np.float32, block))
            elif name.startswith("dispatch"):
                assert out[0].dtype == args[0].dtype
                np.testing.assert_array_equal(bits(np.asarray(out[0])), ref_x)
                np.testing.assert_array_equal(np.asarray(out[1]), ref_p)
            elif name.startswith("sort_chunks vjp"):
                assert out.dtype == args[0].dtype  # rows sorted back from the sorted order: raw's bytes
                np.testing.assert_array_equal(bits(np.asarray(out)), RP.sort_chunks_backward(raw, split, order)[0])
            else:
                assert out.dtype == args[0].dtype
                np.testing.assert_array_equal(bits(np.asarray(out)), ref_sc)
    # batched: vmap runs the callback per batch element, the bytes still uint8 across it
    xb = jax.lax.bitcast_convert_type(jnp.asarray(np.stack([raw, raw[::-1]])), jnp.float8_e4m3fn)
    ob = jax.jit(jax.vmap(lambda a: moe_rt.jax.dispatch(a, jplan)[0]))(xb)
    assert ob.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(bits(np.asarray(ob[0])), ref_x)
    np.testing.assert_array_equal(bits(np.asarray(ob[1])), RP.dispatch(raw[::-1], cplan._dict())[0])
    # the op inside the callback sees FP8: combine refuses it when traced, as the core op does
    xp = moe_rt.jax.dispatch(jax.lax.bitcast_convert_type(jnp.asarray(raw), jnp.float8_e4m3fn), jplan)[0]
    with pytest.raises(TypeError, match="y_permuted: float8_e4m3fn rows"):
        moe_rt.jax.combine(xp, jplan)
    # the core ops given JAX FP8 arrays import them through DLPack as uint8 (a bitcast), never as FP8
    consumed = []
    consume = moe_rt._dlpack.consume

    def consume_watched(obj, **kw):
        consumed.append(np.dtype(obj.dtype))
        return consume(obj, **kw)

    monkeypatch.setattr(moe_rt._dlpack, "consume", consume_watched)
    for dt, jdt in fp8.items():
        o = moe_rt.dispatch(jax.lax.bitcast_convert_type(jnp.asarray(raw), jdt),
                            moe_rt.make_plan(jnp.asarray(idx), E, align_size=4))[0]
        assert o.dtype == jdt
        np.testing.assert_array_equal(bits(np.asarray(o)), ref_x)
        sc = moe_rt.sort_chunks(jax.lax.bitcast_convert_type(jnp.asarray(raw), jdt), split, order)
        assert sc.dtype == jdt
        np.testing.assert_array_equal(bits(np.asarray(sc)), ref_sc)
    y = moe_rt.dequantize_fp8(jnp.asarray(qr), jnp.asarray(sr), np.float32, block)
    np.testing.assert_array_equal(np.asarray(y), moe_rt.dequantize_fp8(qr, sr, np.float32, block))
    assert np.dtype(np.uint8) in consumed and not any(d in (E4M3, E5M2) for d in consumed), consumed


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_te_fp8_permute(rng):
    from moe_rt import te

    T, E, H = 23, 5, 64
    rm = torch.from_numpy(rng.random((T, E)) < 0.4)
    n = int(rm.sum())
    x = torch.from_numpy(rng.integers(0, 256, (T, H), dtype=np.uint8))
    scales = torch.from_numpy(rng.random((T, H // 32), dtype=np.float32))
    out, rid = te.moe_permute(x.view(torch.float8_e4m3fn), rm, n)
    ref, _ = te.moe_permute(x, rm, n)
    assert out.dtype == torch.float8_e4m3fn and torch.equal(out.view(torch.uint8), ref)
    sp, rid2 = te.moe_permute(scales, rm, n)
    assert torch.equal(rid, rid2)
    for r in range(n):  # scale row r belongs to the token whose data row r holds
        t = int(((rid[:, :E] == r).any(1)).nonzero()[0])
        assert torch.equal(sp[r], scales[t]) and torch.equal(out[r].view(torch.uint8), x[t])
    probs = torch.rand(T, E)
    probs[0] = 0
    o2, pp, _ = te.moe_permute_with_probs(x.view(torch.float8_e4m3fn), probs, rm, n)
    assert not o2.view(torch.uint8)[pp == 0].any()
    with pytest.raises(TypeError, match="inp: torch.float8_e4m3fn rows cannot be unpermuted"):
        te.moe_unpermute(out, rid, restore_shape=(T, H))


# -- bad input -------------------------------------------------------------------------------------------

def test_bad_input(rng):
    x = rng.standard_normal((4, 256)).astype(np.float32)
    q, s = moe_rt.quantize_fp8(x)
    cases = [
        (lambda: moe_rt.quantize_fp8(x.astype(np.float64)), TypeError, "x: dtype"),
        (lambda: moe_rt.quantize_fp8(x[0]), ValueError, "x: expected a 2-D"),
        (lambda: moe_rt.quantize_fp8(x, 0), ValueError, "block: must be >= 1"),
        (lambda: moe_rt.quantize_fp8(x, 1.5), TypeError, "block: expected an int"),
        (lambda: moe_rt.dequantize_fp8(q.view(np.uint8), s), TypeError, "x_fp8: expected float8_e4m3fn"),
        (lambda: moe_rt.dequantize_fp8(q.view(np.uint8).view(E5M2), s), TypeError, "x_fp8: expected float8_e4m3fn"),
        (lambda: moe_rt.dequantize_fp8(q, s.astype(np.float16)), TypeError, "scales: dtype"),
        (lambda: moe_rt.dequantize_fp8(q, s[:, :1]), ValueError, r"scales: expected shape \[T, ceil\(H/block\)\]"),
        (lambda: moe_rt.dequantize_fp8(q, s, block=64), ValueError, "scales: expected shape"),
        (lambda: moe_rt.dequantize_fp8(q, s, np.int32), TypeError, "dtype: expected float32"),
        (lambda: moe_rt.dequantize_fp8(q, s, "float64"), TypeError, "dtype: expected float32"),
    ]
    plan = moe_rt.make_plan(np.zeros((4, 1), np.int32), 2)
    cases += [
        (lambda: moe_rt.dispatch_fp8(x, s, plan), TypeError, "x_fp8: expected FP8"),
        (lambda: moe_rt.dispatch_fp8(q, s[:3], plan), ValueError, "scales: expected one row per token"),
        (lambda: moe_rt.dispatch_fp8(q, s.astype(np.float64), plan), TypeError, "scales: dtype"),
        (lambda: moe_rt.combine(moe_rt.dispatch(q, plan)[0], plan), TypeError, "y_permuted: float8_e4m3fn rows"),
        (lambda: moe_rt.dispatch_backward(moe_rt.dispatch(q, plan)[0], plan), TypeError, "grad_x_permuted: float8"),
    ]
    for f, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            f()
    if torch is not None:
        qt = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
        with pytest.raises(TypeError, match="dtype: expected a torch.dtype"):
            moe_rt.torch.dequantize_fp8(qt, torch.from_numpy(s), "bfloat16")
        with pytest.raises(ValueError, match="scales: expected shape"):
            moe_rt.torch.dequantize_fp8(qt, torch.from_numpy(s[:, :1]))
        with pytest.raises(TypeError, match="x_fp8: expected float8_e4m3fn"):
            moe_rt.torch.dequantize_fp8(qt.view(torch.float8_e5m2), torch.from_numpy(s))
    if jax is not None:
        with pytest.raises(ValueError, match="scales: expected shape"):
            moe_rt.jax.dequantize_fp8(jnp.asarray(q), jnp.asarray(s[:, :1]))
        with pytest.raises(TypeError, match="x: dtype"):
            moe_rt.jax.quantize_fp8(jnp.zeros((2, 128), jnp.int32))


# -- the kernels compile without a GPU ------------------------------------------------------------------

def _nvrtc():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        moe_rt._jit.cuda_include_dir()
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _nvrtc(), reason="NVRTC or CUDA headers not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fp8_kernels_compile_offline(arch):
    """Every registered instantiation of kernels/fp8.cu (cuda_fp8.h found through the include path; the packing
    of a one-pass FP8 dispatch's rows too) compiles alone for sm_80 (the conversions emulated) and sm_90 (the
    hardware e4m3 conversions)."""
    from moe_rt import _jit

    names = _jit.REGISTRY["fp8.cu"]
    assert len(names) == 14  # quantize and dequantize per dtype and V4, fp8_pack_rows per W4
    for n in names:
        image, lowered = _jit.compile_offline("fp8.cu", arch, [n])
        assert lowered[n].encode() in image
    ptx, _ = _jit.compile_offline("fp8.cu", "compute_90", ["quantize_fp8<__nv_bfloat16, true>"])
    ptx = ptx.decode()
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx and "div.rn.ftz" not in ptx


# -- CUDA ------------------------------------------------------------------------------------------------

def _cupy():
    import cupy

    return cupy


def _jax_gpu():
    """JAX's first GPU, or None (JAX missing or without CUDA here)."""
    if jax is None:
        return None
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("T,H,block,offset", [(257, 7168, 128, 0), (9, 264, 128, 0), (33, 300, 128, 0),
                                              (31, 388, 128, 1), (19, 130, 64, 0), (7, 45, 7, 0), (65, 512, 256, 0),
                                              (1, 4, 128, 0), (0, 128, 128, 0)])
def test_gpu_quantize_bit_exact(rng, dtype, T, H, block, offset):
    cp = _cupy()
    x = edge_inputs(rng, T, H, dtype, block) if T else np.zeros((T, H), dtype)
    qr, sr = moe_rt.quantize_fp8(x, block)
    # CuPy holds no FP8 dtype: a CuPy caller is refused, naming the argument
    with pytest.raises(TypeError, match=r"x: a cupy array, and the result would be FP8"):
        moe_rt.quantize_fp8(cp.asarray(x), block)
    if torch is not None:
        tdt = {np.dtype(np.float32): torch.float32, BF16: torch.bfloat16, np.dtype(np.float16): torch.float16}[dtype]
        # offset 1: the rows start one element past an aligned address (the scalar kernels)
        buf = torch.from_numpy(np.concatenate([np.zeros(offset, np.float32), x.astype(np.float32).reshape(-1)]))
        xd = buf.cuda().to(tdt)[offset:].view(T, H)
        q, s = moe_rt.quantize_fp8(xd, block)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and q.is_cuda
        np.testing.assert_array_equal(q.view(torch.uint8).cpu().numpy(), bits(qr))
        np.testing.assert_array_equal(s.cpu().numpy().view(np.uint32), sr.view(np.uint32))
        for out, tout in ((np.float32, torch.int32), (BF16, torch.int16), (np.float16, torch.int16)):
            y = moe_rt.dequantize_fp8(q, s, out, block)
            yr = moe_rt.dequantize_fp8(qr, sr, out, block)
            np.testing.assert_array_equal(y.view(tout).cpu().numpy().view(bits(yr).dtype), bits(yr))
    if torch is not None and T:
        xt = torch.from_numpy(x.astype(np.float32)).cuda().to(tdt)
        # each case compiles afresh: the cases' shapes and dtypes would pass Dynamo's recompile limit on one
        # code object (recompiles across calls are checked in test_torch_compile_recompiles)
        torch._dynamo.reset()
        for f in (moe_rt.quantize_fp8, moe_rt.torch.quantize_fp8,
                  torch.compile(moe_rt.torch.quantize_fp8, fullgraph=True)):
            qt, st = f(xt, block)
            assert qt.dtype == torch.float8_e4m3fn and qt.is_cuda
            np.testing.assert_array_equal(qt.view(torch.uint8).cpu().numpy(), bits(qr))
            np.testing.assert_array_equal(st.cpu().numpy().view(np.uint32), sr.view(np.uint32))
        s2 = torch.cuda.Stream()
        with torch.cuda.stream(s2):
            qs, ss = moe_rt.quantize_fp8(xt, block, stream=s2)  # through DLPack: FP8 made as uint8 there
            yt = moe_rt.dequantize_fp8(qt, st, torch.bfloat16, block, stream=s2)
        s2.synchronize()
        assert qs.dtype == torch.float8_e4m3fn
        np.testing.assert_array_equal(qs.view(torch.uint8).cpu().numpy(), bits(qr))
        np.testing.assert_array_equal(ss.cpu().numpy().view(np.uint32), sr.view(np.uint32))
        np.testing.assert_array_equal(yt.view(torch.int16).cpu().numpy(),
                                      bits(moe_rt.dequantize_fp8(qr, sr, BF16, block)).view(np.int16))
    if _jax_gpu() is not None and T:
        xj = jax.device_put(jnp.asarray(x), _jax_gpu())
        qj, sj = jax.jit(lambda a: moe_rt.jax.quantize_fp8(a, block))(xj)
        np.testing.assert_array_equal(bits(np.asarray(qj)), bits(qr))
        qe, se = moe_rt.quantize_fp8(xj, block)  # the core op on JAX arrays (eager, through DLPack)
        assert qe.dtype == jnp.float8_e4m3fn
        np.testing.assert_array_equal(bits(np.asarray(qe)), bits(qr))
        np.testing.assert_array_equal(bits(np.asarray(moe_rt.dequantize_fp8(qe, se, np.float32, block))),
                                      bits(moe_rt.dequantize_fp8(qr, sr, np.float32, block)))
        yj = jax.jit(lambda a, b: moe_rt.jax.dequantize_fp8(a, b, jnp.float32, block))(qj, sj)
        np.testing.assert_array_equal(np.asarray(yj), moe_rt.dequantize_fp8(qr, sr, np.float32, block))


_DIV_CHECK = r"""
#include "moe_rt/fp8.cuh"
using namespace moe_rt;
__device__ unsigned mix(unsigned x) { x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; return x ^ (x >> 16); }
// n random pairs (s in [2^-60, 2^60), |a| <= 448.5 s: every bit pattern of a's significand, subnormal a too);
// counts[0]: quotients with |a / s| >= 2^-11 where div_by_scale and div_rn differ, counts[1]: e4m3 codes that
// differ anywhere, counts[2]: pairs checked, counts[3]: codes where div_by_scale_pos of |a| with a's sign put
// in the code's bit 7 (the bf16 quantize's form) differs from div_rn's
extern "C" __global__ void div_check(unsigned seed, unsigned long long n, unsigned long long* counts) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const unsigned h1 = mix((unsigned)i ^ seed), h2 = mix(h1 + 0x9e3779b9u), h3 = mix(h2 ^ 0x1234567u);
    const float s = __uint_as_float(((67u + h1 % 120u) << 23) | (h2 & 0x7fffffu));
    float a = __uint_as_float(h3);
    if (!(fabsf(a) <= 448.5f * s)) {
      a = mul_rn(__uint_as_float((h3 & 0x807fffffu) | ((112u + (h3 >> 23) % 24u) << 23)), s);
      if (!(fabsf(a) <= 448.5f * s)) continue;
    }
    const float r = div_rn(1.0f, s), fast = div_by_scale(a, -s, r), want = div_rn(a, s);
    if (__float_as_uint(fast) != __float_as_uint(want) && fabsf(want) >= 0x1p-11f) atomicAdd(counts, 1ull);
    if (to_e4m3(fast) != to_e4m3(want)) atomicAdd(counts + 1, 1ull);
    const unsigned char pos = to_e4m3(div_by_scale_pos(fabsf(a), -s, r)) | (__float_as_uint(a) >> 31 << 7);
    if (pos != to_e4m3(want)) atomicAdd(counts + 3, 1ull);
    atomicAdd(counts + 2, 1ull);
  }
}
"""


@pytest.mark.gpu
def test_gpu_div_by_scale_matches_div_rn():
    """div_by_scale (the quantize's quotient: a product and two FMAs by the scale's reciprocal) against div_rn
    on 2^28 random pairs in its range: the same fp32 quotient wherever |a / s| >= 2^-11, the same e4m3 code
    everywhere (below that both round to a signed zero); and div_by_scale_pos of |a| with a's sign set in the
    code afterwards (the bf16 quantize) gives div_rn's code everywhere."""
    cp = _cupy()
    from moe_rt import _jit

    opts = tuple(o for o in _jit._program_options("sm_90") if not o.startswith("-arch"))
    fn = cp.RawModule(code=_DIV_CHECK, options=opts).get_function("div_check")
    counts = cp.zeros(4, cp.uint64)
    for seed in (1, 7919):
        fn((264,), (256,), (np.uint32(seed), np.uint64(1 << 27), counts))
    bad_q, bad_code, checked, bad_pos = (int(v) for v in cp.asnumpy(counts))
    assert checked > (1 << 27) and bad_q == 0 and bad_code == 0 and bad_pos == 0


_DEQ_CHECK = r"""
#include "moe_rt/fp8.cuh"
using namespace moe_rt;
__device__ unsigned mix(unsigned x) { x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; return x ^ (x >> 16); }
template <typename T> __device__ unsigned bits_of(T v) {
  unsigned u = 0;
  memcpy(&u, &v, sizeof(T));
  return u;
}
// n random (four codes, scale) pairs, the scales any fp32 bits (NaN, inf, subnormal), normal, subnormal or one of
// the special values: counts[0] values where dequant4 and the scalar form store_as(mul_rn(from_e4m3(code), s))
// differ in their bits, counts[1] values checked; first: a differing (codes, scale bits), or 0xffffffff
template <typename T>
__global__ void deq_check(unsigned seed, unsigned long long n, unsigned long long* counts, unsigned* first) {
  unsigned long long bad = 0, seen = 0;
  const float special[8] = {0.0f, -0.0f, __int_as_float(0x7f800000), __int_as_float(0xff800000),
                            __int_as_float(0x7fc00000), 1.0f, __int_as_float(1), 3.4028235e38f};
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const unsigned w = mix((unsigned)i ^ seed), h2 = mix(w + 0x9e3779b9u), h3 = mix(h2 ^ 0x1234567u);
    float s;
    switch (h2 & 3) {
      case 0: s = __uint_as_float(h3); break;
      case 1: s = __uint_as_float(((100u + h3 % 60u) << 23) | (h3 & 0x807fffffu)); break;
      case 2: s = __uint_as_float(h3 & 0x807fffffu); break;
      default: s = special[h3 & 7]; break;
    }
    T fast[4];
    dequant4(w, s, fast);
    for (int j = 0; j < 4; ++j) {
      const T slow = store_as<T>(mul_rn(from_e4m3((unsigned char)(w >> (8 * j))), s));
      if (bits_of(fast[j]) != bits_of(slow)) {
        ++bad;
        if (atomicCAS(first, 0xffffffffu, w) == 0xffffffffu) first[1] = __float_as_uint(s);
      }
      ++seen;
    }
  }
  atomicAdd(counts, bad);
  atomicAdd(counts + 1, seen);
}
"""


@pytest.mark.gpu
def test_gpu_dequant4_matches_the_scalar_form():
    """dequant4 (the dequantizing kernels' conversion: two codes an e4m3x2 conversion, two products a bf16x2 /
    f16x2 rounding) bit for bit against the scalar form store_as<T>(mul_rn(from_e4m3(code), s)) on 2^26 random
    words of four codes (every code, NaN codes included) with scales of any bits (NaN, inf, zero, subnormal),
    for fp32, bf16 and fp16."""
    cp = _cupy()
    from moe_rt import _jit

    opts = tuple(o for o in _jit._program_options("sm_90") if not o.startswith("-arch"))
    names = [f"deq_check<{t}>" for t in ("float", "__nv_bfloat16", "__half")]
    mod = cp.RawModule(code=_DEQ_CHECK, options=opts, name_expressions=names)
    for name in names:
        counts = cp.zeros(2, cp.uint64)
        first = cp.full(2, 0xFFFFFFFF, cp.uint32)
        mod.get_function(name)((264,), (256,), (np.uint32(12345), np.uint64(1 << 26), counts, first))
        bad, seen = (int(v) for v in cp.asnumpy(counts))
        assert seen == 4 << 26 and bad == 0, (name, bad, [hex(int(v)) for v in cp.asnumpy(first)])


@pytest.mark.gpu
@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("T,H", [(1031, 7168), (33, 300), (9, 77), (5, 4)])
def test_gpu_quantize_packed_rows(rng, dtype, T, H):
    """The packed rows of the one-pass FP8 dispatch, written into poisoned rows from x (the sender's quantize,
    moe_rt.fp8.launch_quantize_packed) and from a pre-quantized pair (launch_pack): the codes, the scales at
    byte ceil4(H), every other byte of a row zero, bit for bit."""
    cp = _cupy()
    from moe_rt import fp8 as F

    x = edge_inputs(rng, T, H, dtype, 128)
    qr, sr = moe_rt.quantize_fp8(x, 128)
    S, at, rb = F.packed_layout(H, 128)
    want = np.zeros((T, rb), np.uint8)
    want[:, :H] = bits(qr)
    want[:, at:at + 4 * S] = sr.view(np.uint8).reshape(T, 4 * S)
    tdt = {np.dtype(np.float32): torch.float32, BF16: torch.bfloat16, np.dtype(np.float16): torch.float16}[dtype]
    xt = torch.from_numpy(x.astype(np.float32)).cuda().to(tdt)
    # the launcher reads shape, dtype and data.ptr (ep.py hands it its DevArray; CuPy has no bfloat16)
    xd = SimpleNamespace(shape=(T, H), dtype=dtype, data=SimpleNamespace(ptr=xt.data_ptr()))
    packed = cp.full((T, rb), 0xA5, cp.uint8)
    torch.cuda.synchronize()
    F.launch_quantize_packed(xd, packed, 128, 0, cp.cuda.get_current_stream().ptr)
    np.testing.assert_array_equal(cp.asnumpy(packed), want)
    # a pre-quantized pair into the same rows (fp8_pack_rows), at offsets 0 and 1 (4-byte and 1-byte words)
    for off in (0, 1):
        qd = cp.asarray(np.concatenate([np.zeros(off, np.uint8), bits(qr).reshape(-1)]))[off:].reshape(T, H)
        packed.fill(0xA5)
        F.launch_pack(qd, cp.asarray(sr), packed, 128, 0, cp.cuda.get_current_stream().ptr)
        np.testing.assert_array_equal(cp.asnumpy(packed), want)


@pytest.mark.gpu
@pytest.mark.parametrize("out", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("T,H,block,offset", [(257, 7168, 128, 0), (9, 264, 128, 0), (5, 392, 128, 0),
                                              (33, 300, 128, 0), (7, 264, 128, 3), (19, 130, 64, 0)])
def test_gpu_dequantize_into_poisoned_rows(rng, out, T, H, block, offset):
    """The dequantize kernels (the two-block items of block 128 and H % 8 == 0, fp32's split channels, short
    last blocks, an odd number of blocks; the generic kernels for the rest and for codes at an odd offset)
    write every element of a poisoned output, bit for bit the reference's."""
    cp = _cupy()
    from moe_rt import fp8 as F

    qr, sr = moe_rt.quantize_fp8(edge_inputs(rng, T, H, np.float32, block), block)
    want = bits(moe_rt.dequantize_fp8(qr, sr, out, block))
    qd = cp.asarray(np.concatenate([np.zeros(offset, np.uint8), bits(qr).reshape(-1)]))[offset:].reshape(T, H)
    y = cp.full((T, H), 0x7FA5A5A5 if out.itemsize == 4 else 0x7DA5, cp.uint32 if out.itemsize == 4 else cp.uint16)
    F.launch_dequantize(qd, cp.asarray(sr), SimpleNamespace(shape=(T, H), dtype=out, data=y.data), block, 0,
                        cp.cuda.get_current_stream().ptr)
    np.testing.assert_array_equal(cp.asnumpy(y), want.view(y.dtype))


@pytest.mark.gpu
@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("tname", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("T,E,K,H,A", [(129, 8, 2, 7168, 1), (37, 5, 3, 33, 16), (64, 16, 4, 256, 128)])
def test_gpu_torch_fp8_dispatch(rng, tname, T, E, K, H, A):
    tdt = getattr(torch, tname)
    idx = _routing(rng, T, E, K)
    raw = rng.integers(0, 256, (T, H), dtype=np.uint8)
    scales = rng.random((T, -(-H // 128)), dtype=np.float32)
    probs = rng.random((T, K), dtype=np.float32)
    cplan = moe_rt.make_plan(idx, E, align_size=A)
    ref_x, ref_p = RP.dispatch(raw, cplan._dict(), probs)
    ref_s, _ = RP.dispatch(scales, cplan._dict())
    dev = torch.device("cuda")
    plan = moe_rt.make_plan(torch.from_numpy(idx).to(dev), E, align_size=A)
    xt = torch.from_numpy(raw).to(dev).view(tdt)
    st, pt = torch.from_numpy(scales).to(dev), torch.from_numpy(probs).to(dev)
    for _ in range(2):  # the second call may replay a recorded launch
        out, pp = moe_rt.dispatch(xt, plan, pt)
        assert out.dtype == tdt and out.is_cuda
        np.testing.assert_array_equal(out.view(torch.uint8).cpu().numpy(), ref_x)
        np.testing.assert_array_equal(pp.cpu().numpy(), ref_p)
    s2 = torch.cuda.Stream()
    with torch.cuda.stream(s2):
        out2, _ = moe_rt.dispatch(xt, plan, stream=s2)  # through DLPack
    s2.synchronize()
    assert out2.dtype == tdt
    np.testing.assert_array_equal(out2.view(torch.uint8).cpu().numpy(), ref_x)
    wide = torch.from_numpy(np.repeat(raw, 2, axis=1)).to(dev).view(tdt)[:, ::2]  # not contiguous
    np.testing.assert_array_equal(moe_rt.dispatch(wide, plan)[0].view(torch.uint8).cpu().numpy(), ref_x)
    xp, sp, _ = moe_rt.dispatch_fp8(xt, st, plan)
    np.testing.assert_array_equal(xp.view(torch.uint8).cpu().numpy(), ref_x)
    np.testing.assert_array_equal(sp.cpu().numpy(), ref_s)
    tp = moe_rt.torch.make_plan(torch.from_numpy(idx).to(dev), E, align_size=A)
    xa, pa = moe_rt.torch.dispatch(xt, tp, pt.clone().requires_grad_())
    np.testing.assert_array_equal(xa.view(torch.uint8).cpu().numpy(), ref_x)
    pa.sum().backward()
    with pytest.raises(TypeError, match="float8"):
        moe_rt.combine(out, plan)
    with pytest.raises(TypeError, match="y_permuted: float8"):
        moe_rt.combine(out, plan, stream=s2)
    # chunks of FP8 rows reordered as bytes (contiguous and strided, on torch's stream and another one)
    split = rng.multinomial(T - 3, np.ones(5) / 5).astype(np.int32)
    order = rng.permutation(5).astype(np.int32)
    exp, _ = RP.sort_chunks(raw, split, order)
    for xs, kw in ((xt, {}), (wide, {}), (xt, dict(stream=s2))):
        got = moe_rt.sort_chunks(xs, split, order, **kw)
        s2.synchronize()
        assert got.dtype == tdt
        np.testing.assert_array_equal(got.view(torch.uint8).cpu().numpy(), exp)
        back = moe_rt.sort_chunks_backward(got, split, order, **kw)
        s2.synchronize()
        assert back.dtype == tdt
        np.testing.assert_array_equal(back.view(torch.uint8).cpu().numpy(), raw)


@pytest.mark.gpu
def test_gpu_cupy_and_jax_fp8_dispatch(rng):
    cp = _cupy()
    T, E, K, H = 45, 6, 2, 96
    idx = _routing(rng, T, E, K)
    raw = rng.integers(0, 256, (T, H), dtype=np.uint8)
    cplan = moe_rt.make_plan(idx, E, align_size=4)
    ref_x, _ = RP.dispatch(raw, cplan._dict())
    plan = moe_rt.make_plan(cp.asarray(idx), E, align_size=4)
    for _ in range(2):  # the second call may replay a recorded launch
        for fp8 in (E4M3, E5M2):
            # CuPy holds no FP8 dtype moe_rt can use: a CuPy FP8 array (if this CuPy can view bytes as one) is
            # refused, naming the argument; the bytes as uint8 are moved unchanged
            try:
                xc = cp.asarray(raw).view(fp8)
            except (TypeError, ValueError):
                xc = None
            if xc is not None:
                with pytest.raises(TypeError, match=f"x: a CuPy {fp8.name} array"):
                    moe_rt.dispatch(xc, plan)
        out, _ = moe_rt.dispatch(cp.asarray(raw), plan)
        assert out.dtype == np.uint8
        np.testing.assert_array_equal(cp.asnumpy(out), ref_x)
    gpu = _jax_gpu()
    if gpu is not None:
        xj = jax.lax.bitcast_convert_type(jax.device_put(jnp.asarray(raw), gpu), jnp.float8_e4m3fn)
        jplan = moe_rt.jax.make_plan(jax.device_put(jnp.asarray(idx), gpu), E, align_size=4)
        for o in (moe_rt.jax.dispatch(xj, jplan)[0], jax.jit(lambda a: moe_rt.jax.dispatch(a, jplan)[0])(xj),
                  moe_rt.dispatch(xj, moe_rt.make_plan(jax.device_put(jnp.asarray(idx), gpu), E,
                                                       align_size=4))[0]):
            assert o.dtype == jnp.float8_e4m3fn
            np.testing.assert_array_equal(bits(np.asarray(o)), ref_x)
