"""The Python ops as a facade over the C core (moe_rt._core), on CPU: a CUDA call validates, allocates and then
makes one core call. Here the arrays are DevArrays at made-up device addresses, the stream is made up, and the
core context is a planning one (moe_rt_context_create_planning: the op validates and plans as on a device and
launches nothing). Each test checks what the facade hands the core (pointers of the inputs and of the results
it returns, sizes, dtype codes, settings, the stream) and that the core planned the launches an independent
call of the C ABI (through ctypes, moe_rt._xla's structures) with the expected arguments plans."""
from __future__ import annotations

import ctypes
import math
import pathlib
import time
import types

import numpy as np
import pytest

pytest.importorskip("cupy", reason="the CUDA paths under test need CuPy (moe_rt installed without a CUDA extra)")

from moe_rt import _arrays, _core, _xla, fp8  # noqa: E402
from moe_rt import permutation as PM  # noqa: E402
from moe_rt import router as R  # noqa: E402
from moe_rt._arrays import DevArray  # noqa: E402

F32, BF16, F16 = np.dtype(np.float32), _arrays.BFLOAT16, np.dtype(np.float16)
I16, I32, I64 = np.dtype(np.int16), np.dtype(np.int32), np.dtype(np.int64)
STREAM = 0x5E0000
CODE = _core.CODES
SF = R.SCORE_FUNCTIONS


class _Ctx:
    def __init__(self, ptr=0):
        self.ptr = ptr

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Mem:
    """Made-up device memory: each array 256-byte aligned plus ``misalign`` bytes."""

    def __init__(self):
        self.next = 0x7F0000000000
        self.made = []

    def __call__(self, shape, dtype, misalign=0):
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        ptr = self.next + misalign
        self.next += (math.prod(shape) * dtype.itemsize + 4096) // 256 * 256
        a = DevArray(ptr, shape, dtype, object(), 0)
        self.made.append(a)
        return a


@pytest.fixture
def core(monkeypatch):
    """A planning context standing in for device 0's core context; ``core.calls``: (op, args) of each core
    call the facade made; ``core.mem``: the made-up memory (results included)."""
    pc = _core.planning()
    ctx = types.SimpleNamespace(ctx=pc, calls=[], mem=_Mem(), last_plan=pc.last_plan)
    monkeypatch.setattr(_core, "device", lambda dev: pc)
    for op in ("topk_with_score", "topk_indices_with_score", "topk_with_score_backward", "scores_for_aux_loss",
               "scores_for_aux_loss_backward", "aux_loss", "aux_loss_backward", "make_plan", "dispatch", "combine",
               "dispatch_backward", "combine_backward", "sort_chunks", "quantize_fp8", "dequantize_fp8",
               "quantize_fp8_rows", "pack_fp8_rows"):
        real = getattr(_core, op)

        def rec(*args, _real=real, _op=op):
            ctx.calls.append((_op, args[1:]))
            return _real(*args)

        monkeypatch.setattr(_core, op, rec)
    monkeypatch.setattr(_arrays, "_default_stream", lambda fw, dev: _Ctx(STREAM))
    monkeypatch.setitem(_arrays._devices, 0, _Ctx())
    monkeypatch.setattr(_arrays.Call, "empty", lambda self, shape, dtype: ctx.mem(shape, dtype))
    monkeypatch.setattr(_arrays.Call, "scratch", lambda self, shape, dtype: ctx.mem(shape, dtype))
    return ctx


# ---- the independent call of the C ABI ---------------------------------------------------------------------

def _abi_plan(fn_name, *args):
    """The launches the C ABI plans for ``fn_name(ctx, *args)`` on a fresh planning context (an H100's facts),
    each as ``_core.Context.last_plan`` gives them."""
    lib = _xla.core()
    dev = _xla._DeviceInfo(132, 228 * 1024, 227 * 1024, 9, 0, 0)
    ctx = ctypes.c_void_p()
    assert lib.moe_rt_context_create_planning(ctypes.byref(dev), ctypes.byref(ctx)) == 0
    try:
        st = getattr(lib, fn_name)(ctx, *args)
        assert st == 0, lib.moe_rt_last_error().decode()
        info = _xla._PlanInfo()
        assert lib.moe_rt_last_plan(ctx, ctypes.byref(info)) == 0
        return [(info.launch[i].file.decode(), info.launch[i].kernel.decode(), info.launch[i].grid,
                 info.launch[i].block, info.launch[i].shared_mem, tuple(info.launch[i].scalars))
                for i in range(info.num_launches)]
    finally:
        lib.moe_rt_context_destroy(ctx)


P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
L = ctypes.c_int64


def _p(a):
    return P(None if a is None else a.ptr)


def _last(core, op):
    assert [c[0] for c in core.calls] == [op], core.calls
    return core.calls[0][1]


# ---- router ------------------------------------------------------------------------------------------------

TOPK_CASES = [  # (T, E, K, dtype, kw, misalign of the logits)
    (128, 256, 8, F32, {}, 0),
    (128, 256, 8, BF16, dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5), 0),
    (77, 2304, 36, F32, dict(score_function="sqrtsoftplus"), 0),
    (5, 130, 2, F16, dict(use_pre_softmax=True), 0),
    (128, 256, 8, F32, dict(score_function="sigmoid", expert_bias=True), 0),
    (128, 256, 8, F32, {}, 4),  # 4-byte aligned rows: no 16-byte vectors
    (1, 16384, 64, BF16, {}, 0),
    (33, 1024, 8, F32, dict(score_function="sigmoid", num_groups=8, group_topk=4, expert_bias=True), 0),
]
ROUTING_FORMS = [("bytemap", None), ("bitmap_u8", None), ("bytemap", I16), ("bytemap", I32), ("bytemap", I64)]


@pytest.mark.parametrize("case", TOPK_CASES)
@pytest.mark.parametrize("form", ROUTING_FORMS, ids=lambda f: f[0] if f[1] is None else f[1].name)
def test_topk_with_score_hands_the_core_its_arrays(core, case, form):
    T, E, K, dt, kw, mis = case
    fmt, idt = form
    kw = dict(kw)
    x = core.mem((T, 3, E) if T == 77 else (T, E), dt, mis)  # leading dims flattened
    bias = core.mem((E,), F32) if kw.pop("expert_bias", False) else None
    probs, routing, inter = R.topk_with_score(x, K, expert_bias=bias, routing_map_format=fmt,
                                              topk_indices_dtype=idt, **kw)
    lead = x.shape[:-1]
    Tf = math.prod(lead)
    assert probs.shape == lead + (E,) and probs.dtype == dt
    assert inter.shape == lead + (E,) and inter.dtype == F32
    rdt = idt if idt is not None else (np.dtype(np.uint8) if fmt == "bitmap_u8" else np.dtype(np.bool_))
    assert routing.dtype == rdt
    assert routing.shape == lead + ((K,) if idt is not None else ((E + 7) // 8,) if fmt == "bitmap_u8" else (E,))
    args = _last(core, "topk_with_score")
    G, g = kw.get("num_groups") or 0, kw.get("group_topk") or 0
    sf = SF[kw.get("score_function", "softmax")]
    pre = int(kw.get("use_pre_softmax", False))
    scale = kw.get("scaling_factor", 1.0)
    want = (x.ptr, CODE[dt], Tf, E, K, sf, pre, G, g, scale, bias.ptr if bias is not None else 0, probs.ptr,
            routing.ptr, CODE[rdt], inter.ptr, STREAM)
    assert args == want
    got = core.last_plan()
    assert got == _abi_plan("moe_rt_topk_with_score", _p(x), I(CODE[dt]), L(Tf), I(E), I(K), I(sf), I(pre), I(G),
                            I(g), F(scale), _p(bias), _p(probs), _p(routing), I(CODE[rdt]), _p(inter), P(STREAM))
    assert got and all(launch[2] > 0 for launch in got)


def test_the_facade_passes_the_real_alignment(core):
    """A misaligned input plans another kernel configuration: the pointer handed over is the array's own."""
    plans = []
    for mis in (0, 4):
        core.calls.clear()
        R.topk_with_score(core.mem((128, 256), F32, mis), 8)
        plans.append(core.last_plan())
    assert plans[0] != plans[1]


def test_topk_with_score_into_a_caller_buffer(core):
    x = core.mem((64, 256), BF16)
    buf = core.mem((64, 8), I32)
    _, routing, _ = R.topk_with_score(x, 8, topk_indices=buf)
    assert routing is buf
    args = _last(core, "topk_with_score")
    assert args[12] == buf.ptr and args[13] == CODE[I32]


@pytest.mark.parametrize("case", TOPK_CASES)
def test_topk_indices_with_score_hands_the_core_its_arrays(core, case):
    T, E, K, dt, kw, mis = case
    kw = dict(kw)
    x = core.mem((T, E), dt, mis)
    bias = core.mem((E,), F32) if kw.pop("expert_bias", False) else None
    idx, w = R.topk_indices_with_score(x, K, expert_bias=bias, **kw)
    assert idx.shape == w.shape == (T, K) and idx.dtype == I32 and w.dtype == F32
    sf = SF[kw.get("score_function", "softmax")]
    G, g = kw.get("num_groups") or 0, kw.get("group_topk") or 0
    pre, scale = int(kw.get("use_pre_softmax", False)), kw.get("scaling_factor", 1.0)
    args = _last(core, "topk_indices_with_score")
    assert args == (x.ptr, CODE[dt], T, E, K, sf, pre, G, g, scale, bias.ptr if bias is not None else 0, idx.ptr,
                    w.ptr, STREAM)
    assert core.last_plan() == _abi_plan("moe_rt_topk_indices_with_score", _p(x), I(CODE[dt]), L(T), I(E), I(K),
                                         I(sf), I(pre), I(G), I(g), F(scale), _p(bias), _p(idx), _p(w), P(STREAM))


BWD_CASES = [(128, 256, 8, F32, "softmax", False), (128, 256, 8, BF16, "sigmoid", False),
             (9, 2304, 36, F16, "sqrtsoftplus", False), (130, 130, 4, F32, "softmax", True),
             (3, 16384, 64, BF16, "softmax", False)]


@pytest.mark.parametrize("case", BWD_CASES)
@pytest.mark.parametrize("form", ROUTING_FORMS, ids=lambda f: f[0] if f[1] is None else f[1].name)
def test_topk_with_score_backward_hands_the_core_its_arrays(core, case, form):
    T, E, K, dt, score, pre = case
    fmt, idt = form
    grad = core.mem((T, E), dt)
    inter = core.mem((T, E), F32)
    if idt is not None:
        routing = core.mem((T, K), idt)
        out = R.topk_with_score_backward(grad, None, inter, K, score_function=score, use_pre_softmax=pre,
                                         scaling_factor=0.5, topk_indices=routing)
    else:
        routing = core.mem((T, (E + 7) // 8), np.uint8) if fmt == "bitmap_u8" else core.mem((T, E), np.bool_)
        out = R.topk_with_score_backward(grad, routing, inter, K, score_function=score, use_pre_softmax=pre,
                                         scaling_factor=0.5, routing_map_format=fmt)
    assert out.shape == (T, E) and out.dtype == dt
    sf = SF[score]
    args = _last(core, "topk_with_score_backward")
    assert args == (grad.ptr, CODE[dt], routing.ptr, CODE[routing.dtype], inter.ptr, T, E, K, sf, int(pre), 0.5,
                    out.ptr, STREAM)
    assert core.last_plan() == _abi_plan("moe_rt_topk_with_score_backward", _p(grad), I(CODE[dt]), _p(routing),
                                         I(CODE[routing.dtype]), _p(inter), L(T), I(E), I(K), I(sf), I(int(pre)),
                                         F(0.5), _p(out), P(STREAM))


@pytest.mark.parametrize("T,E,K,dt,score", [(128, 256, 8, F32, "softmax"), (7, 130, 36, BF16, "sigmoid"),
                                            (4099, 2304, 36, F16, "sqrtsoftplus")])
@pytest.mark.parametrize("fmt", ["bytemap", "bitmap_u8"])
def test_scores_for_aux_loss_and_backward_hand_the_core_their_arrays(core, T, E, K, dt, score, fmt):
    x = core.mem((T, E), dt)
    scores, rmap, inter = R.scores_for_aux_loss(x, K, score, routing_map_format=fmt)
    rdt = np.dtype(np.uint8) if fmt == "bitmap_u8" else np.dtype(np.bool_)
    assert rmap.dtype == rdt and scores.dtype == inter.dtype == F32
    args = _last(core, "scores_for_aux_loss")
    assert args == (x.ptr, CODE[dt], T, E, K, SF[score], scores.ptr, rmap.ptr, CODE[rdt], inter.ptr, STREAM)
    assert core.last_plan() == _abi_plan("moe_rt_scores_for_aux_loss", _p(x), I(CODE[dt]), L(T), I(E), I(K),
                                         I(SF[score]), _p(scores), _p(rmap), I(CODE[rdt]), _p(inter), P(STREAM))
    core.calls.clear()
    g = R.scores_for_aux_loss_backward(scores, inter, K, score, dtype=dt)
    assert g.dtype == dt and g.shape == (T, E)
    args = _last(core, "scores_for_aux_loss_backward")
    assert args == (scores.ptr, inter.ptr, T, E, K, SF[score], g.ptr, CODE[dt], STREAM)
    assert core.last_plan() == _abi_plan("moe_rt_scores_for_aux_loss_backward", _p(scores), _p(inter), L(T), I(E),
                                         I(K), I(SF[score]), _p(g), I(CODE[dt]), P(STREAM))


@pytest.mark.parametrize("R_,C,E,dt,tdt", [(128, 256, 256, F32, I32), (4099, 64, 32, BF16, I64),
                                          (1, 8, 8, F16, F32), (0, 256, 256, F32, I32)])
@pytest.mark.parametrize("device_total", [None, I32, I64])
def test_aux_loss_and_backward_hand_the_core_their_arrays(core, R_, C, E, dt, tdt, device_total):
    probs = core.mem((R_, C), dt)
    tpe = core.mem((C,), tdt)
    total = 1000 if device_total is None else core.mem((), device_total)
    loss = R.aux_loss(probs, tpe, total, E, 8, 0.01)
    assert loss.shape == () and loss.dtype == dt
    args = _last(core, "aux_loss")
    ws = args[13]
    tot = (1000, 0, 0) if device_total is None else (0, total.ptr, CODE[device_total])
    assert ws == _core.aux_loss_workspace_bytes(R_)
    assert args[:12] == (probs.ptr, CODE[dt], R_, C, tpe.ptr, CODE[tdt], *tot, E, 8, np.float32(0.01))
    assert args[14:] == (loss.ptr, STREAM)
    want = _abi_plan("moe_rt_aux_loss", _p(probs), I(CODE[dt]), L(R_), I(C), _p(tpe), I(CODE[tdt]), L(tot[0]),
                     P(tot[1] or None), I(tot[2]), I(E), I(8), F(0.01), P(args[12]), ctypes.c_size_t(ws), _p(loss),
                     P(STREAM))
    assert core.last_plan() == want
    core.calls.clear()
    grad = core.mem((), dt)
    gp = R.aux_loss_backward(grad, R_, tpe, total, E, 8, 0.01)
    assert gp.shape == (R_, C) and gp.dtype == dt
    args = _last(core, "aux_loss_backward")
    assert args == (grad.ptr, CODE[dt], R_, C, tpe.ptr, CODE[tdt], *tot, E, 8, np.float32(0.01), gp.ptr, STREAM)


def test_aux_loss_converts_16_bit_counts_to_float32_first(core, monkeypatch):
    probs = core.mem((16, 64), F32)
    tpe = core.mem((64,), F16)
    conv = core.mem((64,), F32)
    monkeypatch.setattr(_arrays, "as_f32", lambda xp, a: conv if a is tpe else a)
    R.aux_loss(probs, tpe, 16, 64, 8, 0.01)
    args = _last(core, "aux_loss")
    assert args[4:6] == (conv.ptr, CODE[F32])


# ---- permutation ---------------------------------------------------------------------------------------------

def _cplan(t):
    """A facade plan tuple as the C ABI's struct (through ctypes)."""
    return ctypes.byref(_xla._Plan(*t))


PLAN_CASES = [(128, 8, 64, 1, None, I32), (4096, 8, 256, 16, None, I64), (37, 3, 7, 4, 50, I32),
              (5, 8, 8, 1, None, np.dtype(np.bool_)), (0, 2, 4, 1, None, I32), (300, 6, 64, 128, 1000, I32)]


@pytest.mark.parametrize("T,K,E,A,num_out,rdt", PLAN_CASES)
def test_make_plan_hands_the_core_its_arrays(core, T, K, E, A, num_out, rdt):
    is_map = rdt == np.bool_
    routing = core.mem((T, E) if is_map else (T, K), rdt)
    plan = PM.make_plan(routing, E, align_size=A, num_out_tokens=num_out)
    KK = E if is_map else K
    N = PM._num_rows(T, KK, E, A, num_out)
    assert (plan.num_tokens, plan.topk, plan.num_experts, plan.num_rows) == (T, KK, E, N)
    args = _last(core, "make_plan")
    arrays = [plan.dst_row, plan.src_slot, plan.seg_start, plan.counts, plan.tokens_per_expert]
    assert [a.shape for a in arrays] == [(T, KK), (N,), (E + 1,), (E,), (E,)]
    assert all(a.dtype == I32 for a in arrays)
    nws = _core.make_plan_workspace_bytes(T, KK, E)
    assert args[:7] == (routing.ptr, CODE[rdt], T, KK, E, A, -1 if num_out is None else num_out)
    assert args[7:12] == tuple(a.ptr for a in arrays) == PM._core_plan(plan)[:5]
    assert args[13:] == (nws, STREAM)
    # the working memory lies after the plan's arrays in the plan's one buffer
    words = T * KK + N + 3 * E + 1
    buf = next(m for m in core.mem.made if m.ptr == args[7])
    assert args[12] == buf.ptr + 4 * words and buf.nbytes >= 4 * words + nws
    cp = _xla._Plan(*args[7:12])
    assert core.last_plan() == _abi_plan("moe_rt_make_plan", _p(routing), I(CODE[rdt]), L(T), L(KK), I(E), I(A),
                                         L(-1 if num_out is None else num_out), ctypes.byref(cp), P(args[12]),
                                         ctypes.c_size_t(nws), P(STREAM))
    assert PM._core_plan(plan)[5:] == (T, KK, E, N, A)


@pytest.mark.parametrize("T,K,E,H,dt", [(128, 8, 64, 1024, BF16), (37, 3, 7, 33, F32), (64, 4, 16, 7168, F16),
                                        (19, 2, 5, 64, np.dtype(np.uint8)), (0, 2, 4, 16, F32)])
@pytest.mark.parametrize("pdt", [None, F32, BF16, F16])
def test_dispatch_family_hands_the_core_its_arrays(core, T, K, E, H, dt, pdt):
    routing = core.mem((T, K), I32)
    plan = PM.make_plan(routing, E)
    pt = PM._core_plan(plan)
    N = plan.num_rows
    x = core.mem((T, H), dt)
    probs = None if pdt is None else core.mem((T, K), F32)
    core.calls.clear()
    out, pp = PM.dispatch(x, plan, probs, probs_dtype=None if pdt in (None, F32) else None)
    assert out.shape == (N, H) and out.dtype == dt
    args = _last(core, "dispatch")
    moved = pdt is not None  # with no rows or no slots too: the core takes arrays of no element
    assert args == (pt, x.ptr, CODE[dt], H, probs.ptr if moved else 0, out.ptr, pp.ptr if moved else 0,
                    CODE[F32] if moved else 0, STREAM)
    assert core.last_plan() == _abi_plan("moe_rt_dispatch", _cplan(pt), _p(x), I(CODE[dt]), L(H),
                                         P(args[4] or None), _p(out), P(args[6] or None), I(args[7]), P(STREAM))
    if dt == np.uint8:
        return
    core.calls.clear()
    y_perm = core.mem((N, H), dt)
    y = PM.combine(y_perm, plan, probs)
    assert y.shape == (T, H) and y.dtype == dt
    assert _last(core, "combine") == (pt, y_perm.ptr, CODE[dt], H, 0 if probs is None else probs.ptr, y.ptr, STREAM)
    core.calls.clear()
    gpp = None if pdt is None else core.mem((N,), F32)
    gx, gp = PM.dispatch_backward(y_perm, plan, gpp)
    args = _last(core, "dispatch_backward")
    gather = gpp is not None
    assert args == (pt, y_perm.ptr, CODE[dt], H, gpp.ptr if gather else 0, gx.ptr, gp.ptr if gather else 0, STREAM)
    assert (gp is None) == (gpp is None)
    core.calls.clear()
    gy = core.mem((T, H), dt)
    gyp, gp = PM.combine_backward(gy, plan, y_perm if probs is not None else None, probs)
    assert gyp.shape == (N, H) and (gp is None) == (probs is None)
    args = _last(core, "combine_backward")
    weighted = probs is not None and T * K > 0
    assert args == (pt, gy.ptr, CODE[dt], H, y_perm.ptr if weighted else 0, probs.ptr if weighted else 0, gyp.ptr,
                    gp.ptr if weighted else 0, STREAM)
    assert core.last_plan() == _abi_plan("moe_rt_combine_backward", _cplan(pt), _p(gy), I(CODE[dt]), L(H),
                                         P(args[4] or None), P(args[5] or None), _p(gyp), P(args[7] or None),
                                         P(STREAM))


def test_a_plan_from_another_call_is_handed_over_as_made(core):
    plan = PM.make_plan(core.mem((16, 2), I32), 8, _apart=True)
    args = _last(core, "make_plan")
    assert PM._core_plan(plan)[:5] == args[7:12]  # five allocations, each its own address
    assert len(set(args[7:12])) == 5


@pytest.mark.parametrize("N,row,dt,S_,idt", [(8192, (7168,), BF16, 64, I32), (37, (3, 5), F32, 7, I64),
                                            (19, (7,), np.dtype(np.uint8), 3, I32), (9, (4,), I64, 0, I32)])
@pytest.mark.parametrize("probs", [False, True])
@pytest.mark.parametrize("bwd", [False, True])
def test_sort_chunks_hands_the_core_its_arrays(core, monkeypatch, N, row, dt, S_, idt, probs, bwd):
    monkeypatch.setattr(PM, "_is_host", lambda a: type(a) is not DevArray)  # device split sizes and order
    x = core.mem((N,) + row, dt)
    split = core.mem((S_,), idt)
    order = core.mem((S_,), idt)
    p = core.mem((N,), F32) if probs else None
    f = PM.sort_chunks_backward if bwd else PM.sort_chunks
    res = f(x, split, order, **({"grad_probs": p} if bwd else {"probs": p}))
    out, po = res if probs else (res, None)
    assert out.shape == x.shape and out.dtype == dt
    args = _last(core, "sort_chunks")
    nws = _core.sort_chunks_workspace_bytes(S_)
    row_bytes = int(np.prod(row)) * np.dtype(dt).itemsize
    assert args[:12] == (x.ptr, N, row_bytes, split.ptr if S_ else 0, order.ptr if S_ else 0, CODE[idt], S_,
                         p.ptr if probs else 0, out.ptr, po.ptr if probs else 0, int(bwd), args[11])
    assert args[12:] == (nws, STREAM)


@pytest.mark.parametrize("T,H,block,dt", [(4096, 7168, 128, BF16), (37, 130, 128, F32), (5, 64, 64, F16)])
def test_fp8_casts_hand_the_core_their_arrays(core, T, H, block, dt):
    x = core.mem((T, H), dt)
    q, s = fp8.quantize_fp8(x, block)
    assert q.dtype == _arrays.FLOAT8_E4M3 and s.shape == (T, -(-H // block)) and s.dtype == F32
    assert _last(core, "quantize_fp8") == (x.ptr, CODE[dt], T, H, block, q.ptr, s.ptr, STREAM)
    assert core.last_plan() == _abi_plan("moe_rt_quantize_fp8", _p(x), I(CODE[dt]), L(T), L(H), I(block), _p(q),
                                         _p(s), P(STREAM))
    core.calls.clear()
    y = fp8.dequantize_fp8(q, s, dt, block)
    assert y.dtype == dt and y.shape == (T, H)
    assert _last(core, "dequantize_fp8") == (q.ptr, s.ptr, T, H, block, y.ptr, CODE[dt], STREAM)


@pytest.mark.parametrize("T,H,dt", [(4096, 7168, BF16), (9, 77, F32)])
def test_packed_quantize_hands_the_core_its_rows(core, T, H, dt):
    # the FP8 dispatch's quantize into packed rows (moe_rt.fp8.launch_quantize_packed): one core call on the
    # caller's stream pointer, the rows' stride the array's
    x = core.mem((T, H), dt)
    S, at, rb = fp8.packed_layout(H)
    packed = core.mem((T, rb), np.uint8)
    fp8.launch_quantize_packed(x, packed, 128, 0, STREAM)
    assert _last(core, "quantize_fp8_rows") == (x.ptr, CODE[dt], T, H, 128, packed.ptr, rb, STREAM)
    assert core.last_plan() == _abi_plan("moe_rt_quantize_fp8_rows", _p(x), I(CODE[dt]), L(T), L(H), I(128),
                                         _p(packed), L(rb), P(STREAM))


@pytest.mark.parametrize("T,H", [(4096, 7168), (9, 77)])
def test_pair_packing_hands_the_core_its_rows(core, T, H):
    # a pre-quantized pair into the FP8 dispatch's packed rows (moe_rt.fp8.launch_pack): one core call on the
    # caller's stream pointer
    S, at, rb = fp8.packed_layout(H)
    q, sc, packed = core.mem((T, H), np.uint8), core.mem((T, S), F32), core.mem((T, rb), np.uint8)
    fp8.launch_pack(q, sc, packed, 128, 0, STREAM)
    assert _last(core, "pack_fp8_rows") == (q.ptr, sc.ptr, T, H, 128, packed.ptr, rb, STREAM)
    assert core.last_plan() == _abi_plan("moe_rt_pack_fp8_rows", _p(q), _p(sc), L(T), L(H), I(128), _p(packed),
                                         L(rb), P(STREAM))


# ---- errors ------------------------------------------------------------------------------------------------

def test_core_errors_raise_with_the_core_message():
    ctx = _core.planning()
    with pytest.raises(ValueError, match="topk: must be <= num_experts"):
        _core.topk_with_score(ctx, 1 << 20, CODE[F32], 128, 256, 300, 1, 0, 0, 0, 1.0, 0, 2 << 20, 3 << 20,
                              CODE[np.dtype(np.bool_)], 4 << 20, 0)
    with pytest.raises(ValueError, match="logits"):
        _core.topk_with_score(ctx, 0, CODE[F32], 128, 256, 8, 1, 0, 0, 0, 1.0, 0, 2 << 20, 3 << 20,
                              CODE[np.dtype(np.bool_)], 4 << 20, 0)
    with pytest.raises(ValueError, match="dtype"):
        _core.topk_with_score(ctx, 1 << 20, 99, 128, 256, 8, 1, 0, 0, 0, 1.0, 0, 2 << 20, 3 << 20,
                              CODE[np.dtype(np.bool_)], 4 << 20, 0)
    with pytest.raises(ValueError, match="routing"):
        _core.topk_with_score_backward(ctx, 1 << 20, CODE[F32], 2 << 20, CODE[F32], 3 << 20, 128, 256, 8, 1, 0, 1.0,
                                       4 << 20, 0)
    with pytest.raises(ValueError):
        _core.aux_loss(ctx, 1 << 20, CODE[F32], 16, 64, 2 << 20, CODE[np.dtype(np.bool_)], 16, 0, 0, 64, 8, 0.01,
                       3 << 20, 1 << 16, 4 << 20, 0)


def test_a_core_failure_raises_and_nothing_falls_back(monkeypatch, tmp_path):
    """With no CUDA driver here, making the device's core context fails (after its kernel cache folder got a
    manifest with the error word's module for the device's architecture): the op raises the core's error (no
    other path runs the op)."""
    from moe_rt import _jit

    monkeypatch.setenv("MOE_RT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(_jit, "device_properties", lambda dev: {"cc": (9, 0), "sm_count": 132})
    monkeypatch.setattr(_arrays, "_default_stream", lambda fw, dev: _Ctx(STREAM))
    monkeypatch.setitem(_arrays._devices, 0, _Ctx())
    mem = _Mem()
    monkeypatch.setattr(_arrays.Call, "empty", lambda self, shape, dtype: mem(shape, dtype))
    monkeypatch.setattr(_core, "_devices", {})
    monkeypatch.setenv("MOE_RT_LIBCUDA", "/nonexistent/libcuda.so.1")
    with pytest.raises(RuntimeError, match="moe_rt_context_create.*(libcuda|driver)"):
        R.topk_with_score(mem((128, 256), F32), 8)
    manifest = (tmp_path / "manifest.json").read_text()
    assert "error_word_clear" in manifest and "sm_90" in manifest


def test_python_validation_runs_before_the_core(core):
    x = core.mem((128, 256), F32)
    with pytest.raises(ValueError, match="topk"):
        R.topk_with_score(x, 300)
    with pytest.raises(TypeError, match="score_function"):
        R.topk_with_score(x, 8, score_function=1)
    with pytest.raises(ValueError, match="routing_map_format"):
        R.scores_for_aux_loss(x, 8, "softmax", routing_map_format="bits")
    with pytest.raises(ValueError, match="num_groups"):
        R.topk_indices_with_score(x, 8, num_groups=7, group_topk=1)
    assert core.calls == []


def test_the_facade_ops_use_no_record_replay_layer():
    for mod in (R, PM, fp8):
        src = pathlib.Path(mod.__file__).read_text()
        assert "_fast" not in src and "recorder()" not in src, mod.__name__


# ---- host time of the facade (the core call on a planning context: plan lookup, no launch) ---------------

def test_facade_host_time_report(core, capsys):
    """Not a pass/fail bound (this machine is shared and has no GPU): prints the host time of each facade
    path over DevArrays with the planning context as the core, for the report."""
    x = core.mem((128, 256), BF16)
    idx = core.mem((128, 8), I32)
    g = core.mem((128, 256), BF16)
    inter = core.mem((128, 256), F32)
    ops = {
        "topk_with_score": lambda: R.topk_with_score(x, 8, score_function="sigmoid"),
        "topk_indices_with_score": lambda: R.topk_indices_with_score(x, 8),
        "topk_with_score_backward(indices)": lambda: R.topk_with_score_backward(
            g, None, inter, 8, score_function="sigmoid", topk_indices=idx),
    }
    lines = []
    for name, fn in ops.items():
        for _ in range(200):
            fn()
        core.calls.clear()
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        us = (time.perf_counter() - t0) / n * 1e6
        lines.append(f"{name}: {us:.1f} us")
        core.calls.clear()
    with capsys.disabled():
        print("\nfacade host time (CPU, planning core, DevArrays, recording wrapper included): " + "; ".join(lines))


# ---- torch tensors on torch's current device: no CuPy device or stream unless the op uses CuPy -------------

class _Counting:
    """A CuPy device or stream stand-in counting its enters and exits (``log``: shared, in order)."""

    def __init__(self, what, log, ptr=0):
        self.what, self.log, self.ptr = what, log, ptr

    def __enter__(self):
        self.log.append(("enter", self.what))
        return self

    def __exit__(self, *exc):
        self.log.append(("exit", self.what))
        return False


def _torch_stand_ins(monkeypatch, core, current_device=0):
    """Torch CUDA tensors stood in for on CPU (a class of torch's module name, at made-up addresses), torch's
    current device ``current_device`` and stream STREAM, results allocated as such tensors; CuPy's device and
    stream context managers counting. Returns (make tensor, log)."""
    torch = pytest.importorskip("torch")
    log = []

    class Tensor:
        requires_grad = False
        is_cuda = True

        def __init__(self, shape, dtype, contiguous=True):
            n = math.prod(shape)
            self.shape, self.dtype, self._contig = torch.Size(shape), dtype, contiguous
            self._ptr = core.mem((max(n, 1),), np.uint8).ptr

        def get_device(self):
            return 0

        def is_contiguous(self):
            return self._contig

        def data_ptr(self):
            return self._ptr

        def numel(self):
            return math.prod(self.shape)

        def stride(self):
            st, acc = [], 1
            for d in reversed(self.shape):
                st.append(acc)
                acc *= d
            return tuple(reversed(st))

    Tensor.__module__ = "torch.stand_in"
    np_to_torch = {F32: torch.float32, BF16: torch.bfloat16, np.dtype(np.bool_): torch.bool, I32: torch.int32,
                   np.dtype(np.uint8): torch.uint8}

    def empty(self, shape, dtype):
        t = Tensor(tuple(shape), np_to_torch[np.dtype(dtype)])
        return DevArray(t.data_ptr(), tuple(shape), np.dtype(dtype), t, 0)

    monkeypatch.setattr(_arrays.Call, "empty", empty)
    monkeypatch.setattr(_arrays.Call, "scratch", empty)
    monkeypatch.setattr(_arrays, "_torch_raw_stream", lambda dev: STREAM)
    monkeypatch.setattr(_arrays, "_torch_cur_device", lambda: current_device)
    monkeypatch.setitem(_arrays._devices, 0, _Counting("device", log))
    streams = {}
    monkeypatch.setattr(_arrays, "as_cupy_stream",
                        lambda s, dev: streams.setdefault(int(s), _Counting("stream", log, int(s))))
    monkeypatch.setattr(_arrays, "_default_stream", lambda fw, dev: _arrays.as_cupy_stream(STREAM, dev))
    return (lambda shape, dtype=torch.float32, contiguous=True: Tensor(shape, dtype, contiguous)), log


ENTERED = [("enter", "device"), ("enter", "stream"), ("exit", "stream"), ("exit", "device")]


def test_a_torch_call_on_the_current_device_enters_no_cupy_context(core, monkeypatch):
    new, log = _torch_stand_ins(monkeypatch, core)
    import torch

    logits = new((128, 256))
    probs, rmap, inter = R.topk_with_score(logits, 8)
    args = _last(core, "topk_with_score")
    assert args[0] == logits.data_ptr() and args[-1] == STREAM  # torch's stream, as an int
    assert (args[11], args[12], args[14]) == (probs.data_ptr(), rmap.data_ptr(), inter.data_ptr())
    assert rmap.dtype == torch.bool and tuple(probs.shape) == (128, 256)
    core.calls.clear()
    gl = R.topk_with_score_backward(new((128, 256)), rmap, inter, 8, score_function="softmax")
    args = _last(core, "topk_with_score_backward")
    assert args[-1] == STREAM and args[-2] == gl.data_ptr()
    core.calls.clear()
    plan = PM.make_plan(rmap, 256, num_out_tokens=128 * 8)
    ys = new((1024, 64), torch.bfloat16)
    y = PM.combine(ys, plan, probs)
    gys, gp = PM.combine_backward(new((128, 64), torch.bfloat16), plan, ys, probs)
    assert [c[0] for c in core.calls] == ["make_plan", "combine", "combine_backward"]
    assert all(c[1][-1] == STREAM for c in core.calls)
    assert tuple(y.shape) == (128, 64) and tuple(gys.shape) == (1024, 64) and tuple(gp.shape) == (128, 256)
    assert log == []  # no CuPy device or stream entered
    assert getattr(_arrays._light, "call", None) is None


def test_a_light_call_enters_cupy_once_where_the_op_uses_it(core, monkeypatch):
    """call.xp, call.stream and DevArray.cupy() inside a light call make its device and stream CuPy's first
    (once), and the exit leaves them; outside a call nothing is entered."""
    new, log = _torch_stand_ins(monkeypatch, core)
    monkeypatch.setattr(_arrays, "_cupy_over_dense", lambda *a: "view")
    x = new((4, 8))
    for use in (lambda c: c.xp.float32, lambda c: c.stream, lambda c: c["x"].cupy()):
        log.clear()
        with _arrays.Call({"x": x}, lean=True) as call:
            assert call._light and log == []
            use(call)
            use(call)
            assert log == ENTERED[:2]
            assert call.stream.ptr == STREAM == call.stream_ptr
        assert log == ENTERED
    log.clear()
    v = call["x"]
    v._cp = None
    assert v.cupy() == "view" and log == []


def test_torch_calls_off_the_light_path_enter_cupy_as_before(core, monkeypatch):
    """Another current device, a non-contiguous tensor, a given stream or a mixed call: CuPy's device and
    stream are entered for the whole call."""
    new, log = _torch_stand_ins(monkeypatch, core, current_device=1)
    monkeypatch.setattr(_arrays, "_cupy_over", lambda *a: types.SimpleNamespace(shape=(4, 8)))  # a CuPy view
    with _arrays.Call({"x": new((4, 8))}, lean=True) as call:
        assert not call._light and log == ENTERED[:2]
    assert log == ENTERED
    monkeypatch.setattr(_arrays, "_torch_cur_device", lambda: 0)
    for arrays, stream, lean in (({"x": new((4, 8), contiguous=False)}, None, True), ({"x": new((4, 8))}, None, False),
                                 ({"x": new((4, 8))}, STREAM, True)):
        log.clear()
        if stream is not None:  # imported through DLPack on the given stream: a CuPy view
            monkeypatch.setattr(_arrays.Call, "_import", lambda self, obj, name: types.SimpleNamespace())
        with _arrays.Call(arrays, stream=stream, lean=lean) as call:
            assert call.stream_ptr == STREAM and not call._light and log == ENTERED[:2]
        assert log == ENTERED


def test_cupy_arrays_on_cupys_current_device_and_stream_enter_nothing(core, monkeypatch):
    """CuPy's current device and stream are the call's already: nothing is entered; on another device (or a
    given stream) the call's device and stream are entered for the call."""
    log = []

    class ndarray:  # a CuPy array stood in for (CuPy's module name), on device 0
        device = types.SimpleNamespace(id=0)
        dtype, shape, ndim = F32, (4, 8), 2

    ndarray.__module__ = "cupy._core.core"
    monkeypatch.setitem(_arrays._devices, 0, _Counting("device", log))
    stream = _Counting("stream", log, STREAM)
    monkeypatch.setattr(_arrays, "_default_stream", lambda fw, dev: stream)
    monkeypatch.setattr(_arrays, "as_cupy_stream", lambda s, dev: stream)
    for current, given, entered in ((0, None, []), (1, None, ENTERED), (0, STREAM, ENTERED)):
        monkeypatch.setattr(_arrays, "_cupy_device", lambda: current)
        log.clear()
        with _arrays.Call({"x": ndarray()}, stream=given, lean=True) as call:
            assert call.stream is stream and call.stream_ptr == STREAM
        assert log == entered
