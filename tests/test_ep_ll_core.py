"""The C core's low-latency EP ops (csrc/ep_ll.c; moe_rt.h moe_rt_ll_*) in a planning context: the launches
(kernel, grid, block, every argument) equal those moe_rt/ep_ll.py computed with its own launch set-ups before
they moved to the core (their formulas, transcribed below from LowLatencyGroup._dispatch_setup /
_launch_dispatch / _combine_setup / _launch_combine / combine_bwd and DirectTransport.barrier), for bf16 and
FP8 rows, dedup on and off, split phases, T = 0 and odd T; and bad input through the C ABI gets an error
status with a message, never a crash. (tests/test_ep_ll.py checks the same launches through the Python ops.)"""
from __future__ import annotations

import ctypes as C

import pytest

from moe_rt import _core

OP = {"dispatch": 1, "combine": 2, "dispatch_bwd": 3, "combine_bwd": 4}
CTYPE = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}
ISZ = {"float32": 4, "bfloat16": 2, "float16": 2}
# made-up addresses: every region and table apart, 256-byte aligned
BASE = 1 << 40
FLAGS, BAR, STATE, TIMEOUT_WORD, ERR, SET_EPOCH = 0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000


def cdiv(a, b):
    return -(-a // b)


class Group:
    """A core group on a planning context with made-up addresses, and the launches the Python side made."""

    def __init__(self, R=2, me=1, L=3, Tmax=13, K=3, H=40, dtype="bfloat16", num_buffers=2, fp8=False,
                 dedup=True, sm_count=4, per_sm=2, chunk=None, partials=False, sync=0):
        self.R, self.me, self.L, self.Tmax, self.K, self.H, self.dtype = R, me, L, Tmax, K, H, dtype
        self.nb, self.fp8, self.dedup, self.partials = num_buffers, fp8, dedup, partials
        self.C = chunk or max(1, cdiv(Tmax, 128))
        self.S = cdiv(H, 128)
        self.sm, self.resident = sm_count, sm_count * per_sm
        self.ctx = _core.planning(sm_count=sm_count, assumed_regs=65536 // (512 * per_sm) // 8 * 8)
        self.sets = []
        for b in range(num_buffers):
            t = [BASE * (b + 1) + 0x100000 * i for i in range(8)]
            if not fp8:
                t[2] = t[3] = 0
            self.sets.append(tuple(t))
        self.g = _core.ll_group_create(self.ctx, R, me, L, Tmax, K, _core.DTYPE_CODES[dtype], H, self.C, num_buffers,
                                       int(fp8), self.S, int(dedup), 10**9, self.sets, FLAGS, BAR, STATE,
                                       TIMEOUT_WORD, ERR, SET_EPOCH, combine_partials=int(partials), sync=sync)

    def plan(self):
        return [(l[1], l[2], l[3], self.ctx.last_plan_args(i)) for i, l in enumerate(self.ctx.last_plan())]

    # -- the Python side's launches (the formulas of moe_rt/ep_ll.py and _ep_direct.py before the move) --------
    def barrier(self, op):
        return ("ep_direct_barrier", 1, max(32, cdiv(self.R, 32) * 32),
                [BAR, self.R, self.me, STATE, 10**9, TIMEOUT_WORD, OP[op], 0, self.R])

    def tail(self, op):
        return [ERR, STATE, TIMEOUT_WORD, 10**9, OP[op], self.R, self.me, self.L, self.Tmax, self.K, self.C, self.H]

    def vec16(self):
        return (self.H * ISZ[self.dtype]) % 16 == 0 and self.sets[0][0] % 16 == 0

    def dispatch(self, b, T, x, idx, w, idx64, outs, phases, *, op="dispatch", meta=True, scaled=False, zero_k=0,
                 recv_route=0, quant=None):
        """LowLatencyGroup._launch_dispatch + _dispatch_setup (``x``, ``idx``, ``w`` and ``quant``'s codes and
        scales already 0 for T = 0, ``outs`` the six tables with idx, w 0 for T = 0)."""
        s = self.sets[b]
        fp8 = quant is not None
        if fp8:
            vec = self.H % 16 == 0 and s[0] % 16 == 0 and not (quant[0] or x) & 15
        else:
            vec = self.vec16() and not x & 15
        kind = "ep_ll_dispatch_fp8" if fp8 else "ep_ll_dispatch"
        name = f"{kind}<{CTYPE[self.dtype]}, {'long long' if idx64 else 'int'}, {'true' if vec else 'false'}>"
        tabs = [s[1], s[2], s[3]] if fp8 else [s[1]]
        tabs += [s[4], s[5], FLAGS]
        tail = self.tail(op) + ([self.S] if fp8 else [])
        tail += [phases, 2 * self.R * self.Tmax * b, SET_EPOCH + 4 * b if phases != 3 else 0]
        grid = max(1, min(max(cdiv(self.Tmax, self.C), self.L), self.resident))
        if fp8:
            args = [x, quant[0], quant[1], idx, w, T] + tabs + list(outs) + [quant[2], int(self.dedup)] + tail
        else:
            args = ([x, idx, w, T, int(meta), int(scaled), int(self.dedup and not scaled)] + tabs + list(outs)
                    + [zero_k, recv_route] + tail)
        return (name, grid, 512, args)

    def combine(self, b, T, y, gws, route, idx, w, out, grad_w, op, slot_w=0):
        """LowLatencyGroup._launch_combine + _combine_setup (``out`` None: no rows). A group with
        combine_partials: its combine runs the PARTIALS build with the handle's slot_w instead of w."""
        s = self.sets[b]
        partials = int(self.partials and op == "combine")
        if partials:
            w = 0
        yp, outp = y or 0, out or 0
        vec = self.vec16() and not (yp | outp) & 15
        nv = self.H // (16 // ISZ[self.dtype]) if vec else self.H
        items = cdiv(nv, 512) if out is not None else 1
        grid = max(1, min(max(cdiv(self.Tmax, self.C) * self.R, T * items), self.resident))
        args = [yp, gws, route, idx if T else 0, w if T else 0, slot_w if partials else 0, s[6], s[7], FLAGS,
                outp if T else 0, grad_w if T else 0, STATE, TIMEOUT_WORD, 10**9, OP[op], self.R, self.me, self.L,
                self.Tmax, self.K, T, self.C, self.H, 2 * self.R * self.Tmax * b]
        tf = lambda b: "true" if b else "false"  # noqa: E731
        return (f"ep_ll_combine<{CTYPE[self.dtype]}, {tf(vec)}, {tf(partials)}>", grid, 512, args)

    def slot_dot(self, b, y, slot_k, slot_w, dots):
        n = self.L * self.R * self.Tmax
        vec = self.vec16() and not y & 15
        return (f"ep_ll_slot_dot<{CTYPE[self.dtype]}, {'true' if vec else 'false'}>",
                max(1, min(cdiv(n, 8), self.sm * 8)), 256, [self.sets[b][0], y, slot_k, slot_w, dots, n, self.H])


TABLES = (0x71000, 0x72000, 0x73000, 0x74000, 0x75000, 0x76000)  # idx, w, route, slot_k, slot_w, counts


@pytest.mark.parametrize("dtype,H", [("bfloat16", 40), ("float32", 7), ("float16", 256)])
@pytest.mark.parametrize("fp8", [None, "float", "pair", "dequant"])
@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("T", [0, 7, 13])
@pytest.mark.parametrize("phases", [3, 1, 2])
def test_dispatch_launches_equal_the_python_sides(dtype, H, fp8, dedup, T, phases):
    g = Group(H=H, dtype=dtype, fp8=fp8 is not None, dedup=dedup)
    for b, idx64, shift in ((0, False, 0), (1, True, 2), (1, False, 0)):
        x, xq, xs, idx, w = 0x81000 + shift, 0x82000 + shift, 0x83000, 0x84000, 0x85000
        pair = fp8 == "pair"
        _core.ll_dispatch(g.g, b, phases, 0 if pair else x, xq if pair else 0, xs if pair else 0,
                          int(fp8 is not None), int(fp8 == "dequant"), idx, 4 if idx64 else 3, w, T, TABLES, 7)
        outs = TABLES if T else (0, 0) + TABLES[2:]
        z = (lambda p: p if T else 0)
        quant = None if fp8 is None else (z(xq) if pair else 0, z(xs) if pair else 0, int(fp8 == "dequant"))
        want = [g.barrier("dispatch")] if phases & 1 else []
        want.append(g.dispatch(b, T, 0 if pair else z(x), z(idx), z(w), idx64, outs, phases, quant=quant))
        assert g.plan() == want, (b, idx64, shift)


@pytest.mark.parametrize("dtype,H", [("bfloat16", 40), ("float32", 7), ("bfloat16", 7168)])
@pytest.mark.parametrize("T", [0, 5, 13])
@pytest.mark.parametrize("R,Tmax,sm,per_sm", [(2, 13, 4, 2), (4, 1024, 132, 4), (3, 200, 132, 1)])
@pytest.mark.parametrize("partials", [False, True])
def test_combine_and_backward_launches_equal_the_python_sides(dtype, H, T, R, Tmax, sm, per_sm, partials):
    """combine_partials changes combine's launch alone (the PARTIALS build with slot_w instead of w, the same
    grid and block); dispatch_bwd and combine_bwd launch as without it."""
    for dedup in (True, False):
        g = Group(R=R, me=R - 1, Tmax=Tmax, H=H, dtype=dtype, dedup=dedup, sm_count=sm, per_sm=per_sm,
                  partials=partials)
        idx, w, route, slot_k, slot_w = TABLES[:5]
        for b, shift in ((0, 0), (1, 2)):
            y, out, gws, gw, gout, dots = (0x91000 + shift, 0x92000, 0x93000, 0x94000, 0x95000 + shift, 0x96000)
            _core.ll_combine(g.g, b, OP["combine"], y, 0, TABLES, T, out, 0, 7)
            assert g.plan() == [g.barrier("combine"), g.combine(b, T, y, 0, route, idx, w, out, 0, "combine",
                                                                slot_w=slot_w)]
            _core.ll_combine(g.g, b, OP["dispatch_bwd"], y, gws, TABLES, T, out, gw, 7)
            assert g.plan() == [g.barrier("dispatch_bwd"),
                                g.combine(b, T, y, gws, route, idx, 0, out, gw, "dispatch_bwd")]
            _core.ll_combine(g.g, b, OP["combine_bwd"], 0, dots, TABLES, T, 0, gw, 7)
            assert g.plan() == [g.barrier("combine_bwd"),
                                g.combine(b, T, None, dots, route, idx, 0, None, gw, "combine_bwd")]
            for yk in (None, 0xA1000 + shift):
                _core.ll_combine_bwd(g.g, b, gout, yk or 0, TABLES, T, dots if yk else 0, 7)
                z = (lambda p: p if T else 0)
                push = g.dispatch(b, T, z(gout), z(idx), z(w), False, (0,) * 6, 3, op="combine_bwd", meta=False,
                                  scaled=yk is None, zero_k=slot_k, recv_route=route if dedup and yk else 0)
                want = [g.barrier("combine_bwd"), push]
                if yk:
                    want.append(g.slot_dot(b, yk, slot_k, slot_w, dots))
                assert g.plan() == want, (b, yk)


def test_plans_are_cached_per_signature_and_follow_the_call():
    """The same signature again (plan cached in the group) gives the same launches with this call's pointers and
    T; a second group on the same context plans for its own sizes."""
    g = Group()
    for T in (3, 11, 0, 3):
        _core.ll_combine(g.g, 1, OP["combine"], 0x91000, 0, TABLES, T, 0x92000, 0, 7)
        assert g.plan() == [g.barrier("combine"), g.combine(1, T, 0x91000, 0, *TABLES[2:3], *TABLES[:2], 0x92000, 0,
                                                            "combine")]
    g2 = Group(R=4, me=0, L=2, Tmax=300, H=128)
    _core.ll_dispatch(g2.g, 0, 3, 0x81000, 0, 0, 0, 0, 0x84000, 3, 0x85000, 300, TABLES, 7)
    assert g2.plan() == [g2.barrier("dispatch"), g2.dispatch(0, 300, 0x81000, 0x84000, 0x85000, False, TABLES, 3)]


def _pairwise(launches, nb):
    """A barrier group's launches as its pairwise twin (desc.sync = MOE_RT_LL_SYNC_PAIRWISE) makes them: no
    barrier, the fused kernels' *_pairwise builds with two more arguments (the barrier slots' peer table, the
    block count after the sets' split epochs), the slot dot as it was."""
    out = []
    for name, grid, block, args in launches:
        if name == "ep_direct_barrier":
            continue
        base, _, targs = name.partition("<")
        if base in ("ep_ll_dispatch", "ep_ll_dispatch_fp8", "ep_ll_combine"):
            name, args = f"{base}_pairwise<{targs}", list(args) + [BAR, SET_EPOCH + 4 * nb]
        out.append((name, grid, block, args))
    return out


@pytest.mark.parametrize("fp8", [None, "pair", "dequant"])
@pytest.mark.parametrize("T", [0, 7])
@pytest.mark.parametrize("partials", [False, True])
@pytest.mark.parametrize("nb", [1, 2])
def test_pairwise_plans_drop_the_barrier(fp8, T, partials, nb):
    """desc.sync = MOE_RT_LL_SYNC_PAIRWISE: every op plans as in barrier mode less the barrier launch, with the
    pairwise builds of the fused kernels (their extra arguments: BAR, the count word): dispatch in one launch,
    the split push and its receive, combine, dispatch_bwd, combine_bwd's weight gather and combine_bwd with and
    without expert_out (the slot dot unchanged)."""
    gb = Group(fp8=fp8 is not None, partials=partials, num_buffers=nb)
    gp = Group(fp8=fp8 is not None, partials=partials, num_buffers=nb, sync=1)
    b = nb - 1
    pair = fp8 == "pair"
    calls = [lambda g, ph=ph: _core.ll_dispatch(g.g, b, ph, 0 if pair else 0x81000, 0x82000 if pair else 0,
                                                0x83000 if pair else 0, int(fp8 is not None), int(fp8 == "dequant"),
                                                0x84000, 3, 0x85000, T, TABLES, 7) for ph in (3, 1, 2)]
    calls += [lambda g, op=op, a=a, o=o: _core.ll_combine(g.g, b, OP[op], *a, TABLES, T, *o, 7)
              for op, a, o in (("combine", (0x91000, 0), (0x92000, 0)),
                               ("dispatch_bwd", (0x91000, 0x93000), (0x92000, 0x94000)),
                               ("combine_bwd", (0, 0x96000), (0, 0x94000)))]
    calls += [lambda g, yk=yk: _core.ll_combine_bwd(g.g, b, 0x95000, yk, TABLES, T, 0x96000 if yk else 0, 7)
              for yk in (0, 0xA1000)]
    for i, call in enumerate(calls):
        call(gb)
        barrier = gb.plan()
        call(gp)
        pairwise = gp.plan()
        assert pairwise == _pairwise(barrier, nb), i
        assert all(n != "ep_direct_barrier" for n, *_ in pairwise)
        # every fused launch is a pairwise build
        assert all("_pairwise<" in n or n.startswith("ep_ll_slot_dot") for n, *_ in pairwise)


# -- bad input through the C ABI ----------------------------------------------------------------------------

def test_bad_calls_get_error_statuses_with_messages():
    g = Group(fp8=False, num_buffers=1)
    good = dict(buffer_set=0, phases=3, x=0x81000, x_fp8=0, x_scales=0, fp8=0, dequantize=0, idx=0x84000,
                idx_dtype=3, w=0x85000, T=5, tables=TABLES, stream=7)

    def dispatch(**kw):
        a = dict(good, **kw)
        _core.ll_dispatch(g.g, *a.values())

    dispatch()
    for kw, msg in [(dict(buffer_set=1), "buffer_set must be in [0, num_buffers=1), got 1"),
                    (dict(buffer_set=-1), "buffer_set must be in"),
                    (dict(T=14), "num_tokens must be in [0, max_tokens_per_rank=13], got 14"),
                    (dict(T=-1), "num_tokens must be in"),
                    (dict(idx_dtype=0), "idx_dtype: expected int32 or int64, got float32"),
                    (dict(phases=0), "phases must be"), (dict(phases=4), "phases must be"),
                    (dict(fp8=1), "the group has no FP8 receive buffers"),
                    (dict(dequantize=1), "need fp8 = 1"),
                    (dict(x=0), "x is NULL"), (dict(idx=0), "topk_idx is NULL"),
                    (dict(tables=(0,) + TABLES[1:]), "tables->idx is NULL"),
                    (dict(tables=TABLES[:5] + (0,)), "tables->counts is NULL")]:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            dispatch(**kw)
    dispatch(T=0, x=0, idx=0, w=0, tables=(0, 0) + TABLES[2:])  # T = 0: no token arrays needed
    with pytest.raises(ValueError, match="op must be"):
        _core.ll_combine(g.g, 0, 1, 0x91000, 0, TABLES, 5, 0x92000, 0, 7)
    with pytest.raises(ValueError, match="y and out must be NULL"):
        _core.ll_combine(g.g, 0, OP["combine_bwd"], 0x91000, 0x93000, TABLES, 5, 0, 0x94000, 7)
    with pytest.raises(ValueError, match="slot_grads and grad_w come together"):
        _core.ll_combine(g.g, 0, OP["dispatch_bwd"], 0x91000, 0x93000, TABLES, 5, 0x92000, 0, 7)
    recv = g.sets[0][0]
    with pytest.raises(ValueError, match="expert_out: must not be the group's receive buffer"):
        _core.ll_combine_bwd(g.g, 0, 0x95000, recv + 64, TABLES, 5, 0x96000, 7)
    g.g.destroy()
    with pytest.raises(ValueError, match="destroyed"):
        dispatch()


@pytest.mark.parametrize("field,value,msg", [
    (1, 0, "desc.num_ranks must be in"), (2, 2, r"desc.rank must be in \[0, 2\), got 2"),
    (3, 0, "desc.num_local_experts must be >= 1"), (4, 1025, "desc.max_tokens_per_rank must be in"),
    (5, 65, "desc.topk must be in"), (6, 3, "desc.dtype: expected float32, float16 or bfloat16, got int32"),
    (7, 0, "desc.hidden must be in"), (8, 14, "desc.chunk must be in"), (9, 3, "desc.num_buffers must be 1 or 2"),
    (10, 2, "desc.fp8 must be 0 or 1"), (12, 5, "desc.dedup must be 0 or 1"), (13, 0, "desc.timeout_ns must be > 0"),
    (16, 0, "desc.peer_barrier is NULL"), (20, 0, "desc.set_epoch is NULL"),
    ("sync", 2, r"desc.sync must be MOE_RT_LL_SYNC_BARRIER \(0\) or MOE_RT_LL_SYNC_PAIRWISE \(1\), got 2"),
    ("sync", -1, "desc.sync must be")])
def test_bad_group_descriptions_are_refused(field, value, msg):
    ctx = _core.planning()
    sets = [tuple(BASE + 0x100000 * i if i not in (2, 3) else 0 for i in range(8))]
    args = [ctx, 2, 1, 3, 13, 3, 2, 40, 1, 1, 0, 1, 1, 10**9, sets, FLAGS, BAR, STATE, TIMEOUT_WORD, ERR, SET_EPOCH]
    kw = {}
    if isinstance(field, str):
        kw[field] = value
    else:
        args[field] = value
    with pytest.raises(ValueError, match=msg):
        _core.ll_group_create(*args, **kw)


def test_combine_partials_description_and_tables():
    """desc.combine_partials must be 0 or 1; a partials group's combine needs the handle's slot_w (not w), and
    its dispatch_bwd still reads neither."""
    ctx = _core.planning()
    sets = [tuple(BASE + 0x100000 * i if i not in (2, 3) else 0 for i in range(8))]
    args = [ctx, 2, 1, 3, 13, 3, 2, 40, 1, 1, 0, 1, 1, 10**9, sets, FLAGS, BAR, STATE, TIMEOUT_WORD, ERR, SET_EPOCH]
    with pytest.raises(ValueError, match="desc.combine_partials must be 0 or 1, got 2"):
        _core.ll_group_create(*args, combine_partials=2)
    g = Group(num_buffers=1, partials=True)
    no_slot_w = TABLES[:4] + (0,) + TABLES[5:]
    with pytest.raises(ValueError, match=r"tables->slot_w is NULL"):
        _core.ll_combine(g.g, 0, OP["combine"], 0x91000, 0, no_slot_w, 5, 0x92000, 0, 7)
    no_w = TABLES[:1] + (0,) + TABLES[2:]
    _core.ll_combine(g.g, 0, OP["combine"], 0x91000, 0, no_w, 5, 0x92000, 0, 7)
    assert g.plan()[1][3][4:6] == [0, TABLES[4]]  # w, slot_w
    _core.ll_combine(g.g, 0, OP["dispatch_bwd"], 0x91000, 0, no_slot_w, 5, 0x92000, 0, 7)
    assert g.plan()[1][3][4:6] == [0, 0]


def test_bad_buffer_sets_are_refused():
    ctx = _core.planning()
    good = tuple(BASE + 0x100000 * i for i in range(8))
    base = [ctx, 2, 1, 3, 13, 3, 2, 40, 1, 1, 1, 1, 1, 10**9]
    tail = [FLAGS, BAR, STATE, TIMEOUT_WORD, ERR, SET_EPOCH]
    with pytest.raises(ValueError, match=r"desc.set\[0\].peer_recv_q is NULL \(an fp8 group\)"):
        _core.ll_group_create(*base, [good[:2] + (0,) + good[3:]], *tail)
    with pytest.raises(ValueError, match="desc.num_scales must be ceil"):
        _core.ll_group_create(*base[:11], 2, *base[12:], [good], *tail)
    with pytest.raises(ValueError, match=r"desc.set\[1\].peer_back is NULL"):
        _core.ll_group_create(*base[:9], 2, *base[10:], [good, good[:6] + (0,) + good[7:]], *tail)
    nofp8 = base[:10] + [0] + base[11:]
    with pytest.raises(ValueError, match="must be NULL when desc.fp8 is 0"):
        _core.ll_group_create(*nofp8, [good], *tail)


def test_null_group_and_desc_through_the_c_abi():
    """The functions themselves (no Python wrapper in between): NULL group, NULL desc, NULL out."""
    lib = C.CDLL(_core.LIB_PATH)
    lib.moe_rt_last_error.restype = C.c_char_p
    P = C.c_void_p
    lib.moe_rt_ll_dispatch.argtypes = [P, C.c_int, C.c_int, P, P, P, C.c_int, C.c_int, P, C.c_int, P, C.c_int64, P, P]
    lib.moe_rt_ll_combine.argtypes = [P, C.c_int, C.c_int, P, P, P, C.c_int64, P, P, P]
    lib.moe_rt_ll_combine_bwd.argtypes = [P, C.c_int, P, P, P, C.c_int64, P, P]
    lib.moe_rt_ll_group_create.argtypes = [P, P, P]
    lib.moe_rt_ll_group_destroy.argtypes = [P]
    tables = (C.c_void_p * 6)(*TABLES)
    assert lib.moe_rt_ll_dispatch(None, 0, 3, 1, None, None, 0, 0, 1, 3, 1, 1, tables, None) == 1
    assert b"moe_rt_ll_dispatch: group is NULL" in lib.moe_rt_last_error()
    assert lib.moe_rt_ll_combine(None, 0, 2, 1, None, tables, 1, 1, None, None) == 1
    assert b"moe_rt_ll_combine: group is NULL" in lib.moe_rt_last_error()
    assert lib.moe_rt_ll_combine_bwd(None, 0, 1, None, tables, 1, None, None) == 1
    assert b"group is NULL" in lib.moe_rt_last_error()
    out = P(1)
    assert lib.moe_rt_ll_group_create(None, None, C.byref(out)) == 1 and b"ctx is NULL" in lib.moe_rt_last_error()
    lib.moe_rt_context_create_planning.argtypes = [P, P]
    info = (C.c_int32 * 6)(132, 228 * 1024, 227 * 1024, 9, 0, 0)
    ctx = P()
    assert lib.moe_rt_context_create_planning(info, C.byref(ctx)) == 0
    assert lib.moe_rt_ll_group_create(ctx, None, C.byref(out)) == 1 and out.value is None
    assert b"desc is NULL" in lib.moe_rt_last_error()
    assert lib.moe_rt_ll_group_create(ctx, None, None) == 1 and b"out is NULL" in lib.moe_rt_last_error()
    lib.moe_rt_ll_group_destroy(None)
    lib.moe_rt_context_destroy.argtypes = [P]
    lib.moe_rt_context_destroy(ctx)


def _registry_lib():
    lib = C.CDLL(_core.LIB_PATH)
    lib.moe_rt_last_error.restype = C.c_char_p
    P = C.c_void_p
    lib.moe_rt_ll_group_serial.argtypes = [P]
    lib.moe_rt_ll_group_serial.restype = C.c_int64
    lib.moe_rt_ll_group_acquire.argtypes = [C.c_int64, C.c_int64, P]
    lib.moe_rt_ll_group_release.argtypes = [P]
    lib.moe_rt_ll_group_destroy.argtypes = [P]
    lib.moe_rt_ll_group_get_desc.argtypes = [P, P]
    return lib


def test_registry_of_live_groups_through_the_c_abi():
    """moe_rt_ll_group_create lists each group under a serial of its own (never reused), acquire finds the live
    group of an (address, serial) pair and holds it, destroy unlists it at once (a held group is freed by its
    last release), and every other pair fails with a message: what an XLA handler relies on."""
    lib = _registry_lib()
    a, b = Group(R=1, me=0), Group(R=2, me=1)
    sa, sb = a.g.serial, b.g.serial
    assert sa > 0 and sb > sa and lib.moe_rt_ll_group_serial(C.c_void_p(a.g.address)) == sa
    assert lib.moe_rt_ll_group_serial(None) == 0
    held = C.c_void_p()
    assert lib.moe_rt_ll_group_acquire(a.g.address, sa, C.byref(held)) == 0 and held.value == a.g.address
    desc = (C.c_int32 * 4)()  # num_ranks, rank, num_local_experts, max_tokens_per_rank lead the desc
    big = C.create_string_buffer(1024)
    assert lib.moe_rt_ll_group_get_desc(held, big) == 0
    C.memmove(desc, big, C.sizeof(desc))
    assert list(desc) == [1, 0, a.L, a.Tmax]
    for address, serial in ((a.g.address, sb), (b.g.address, sa), (a.g.address + 8, sa), (0, 0)):
        out = C.c_void_p(1)
        assert lib.moe_rt_ll_group_acquire(address, serial, C.byref(out)) == 1 and out.value is None
        msg = lib.moe_rt_last_error()
        assert b"moe_rt_ll_group_acquire: no live low-latency group at address 0x" in msg and b"closed" in msg
    assert lib.moe_rt_ll_group_acquire(a.g.address, sa, None) == 1 and b"out is NULL" in lib.moe_rt_last_error()
    assert lib.moe_rt_ll_group_get_desc(None, big) == 1 and b"group is NULL" in lib.moe_rt_last_error()
    # destroyed while held: unlisted at once; the group's memory stays until the last release
    address = a.g.address
    a.g.destroy()
    assert a.g.address == 0 and a.g.serial == 0
    assert lib.moe_rt_ll_group_acquire(address, sa, C.byref(C.c_void_p())) == 1
    assert lib.moe_rt_ll_group_get_desc(held, big) == 0  # still readable: held
    lib.moe_rt_ll_group_release(held)
    lib.moe_rt_ll_group_release(None)
    # a later group gets a new serial, whatever its address
    c = Group(R=1, me=0)
    assert c.g.serial > sb
    assert lib.moe_rt_ll_group_acquire(c.g.address, sa, C.byref(C.c_void_p())) == 1
    out = C.c_void_p()
    assert lib.moe_rt_ll_group_acquire(b.g.address, sb, C.byref(out)) == 0
    lib.moe_rt_ll_group_release(out)
    b.g.destroy()
    c.g.destroy()


@pytest.mark.parametrize("row_bytes,unit", [(40, "uint2"), (48, "uint4"), (6, "unsigned short"), (3, "unsigned char"),
                                            (20, "unsigned")])
def test_copy_kept_rows_plan(row_bytes, unit):
    """moe_rt_copy_kept_rows in a planning context: one copy_kept_rows launch, the widest unit the row bytes
    allow (the buffers 256-byte aligned), a warp per row with a grid of ceil(N/8) capped at 16 blocks per SM,
    arguments (src, out, keep, N, row units, zero_rest); nothing for N = 0 or empty rows; bad input refused."""
    ctx = _core.planning(sm_count=4)
    src, out, keep = 1 << 20, 2 << 20, 3 << 20
    for N, grid in ((21, 3), (1000, 64)):
        _core.copy_kept_rows(ctx, src, out, keep, N, row_bytes, 1, 0)
        assert [(l[1], l[2], l[3]) for l in ctx.last_plan()] == [(f"copy_kept_rows<{unit}>", grid, 256)]
        units = {"uint4": 16, "uint2": 8, "unsigned": 4, "unsigned short": 2, "unsigned char": 1}[unit]
        assert ctx.last_plan_args(0) == [src, out, keep, N, row_bytes // units, 1]
    _core.copy_kept_rows(ctx, src, out + 2, keep, 5, row_bytes, 0, 0)  # a 2-byte aligned output: narrower units
    assert ctx.last_plan()[0][1] == ("copy_kept_rows<unsigned short>" if row_bytes % 2 == 0
                                     else "copy_kept_rows<unsigned char>")
    assert ctx.last_plan_args(0)[-1] == 0
    for n, rb in ((0, row_bytes), (5, 0)):
        _core.copy_kept_rows(ctx, 0, 0, 0, n, rb, 1, 0)
        assert ctx.last_plan() == []
    for args, msg in (((src, out, keep, -1, row_bytes, 1), "num_rows must be >= 0"),
                      ((src, out, keep, 5, -1, 1), "row_bytes must be >= 0"),
                      ((src, out, keep, 5, row_bytes, 2), "zero_rest must be 0 or 1"),
                      ((0, out, keep, 5, row_bytes, 1), "src is NULL"),
                      ((src, out, 0, 5, row_bytes, 1), "keep is NULL")):
        with pytest.raises(ValueError, match=msg):
            _core.copy_kept_rows(ctx, *args, 0)
