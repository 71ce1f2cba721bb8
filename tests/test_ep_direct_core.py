"""The C core's direct EP transport (csrc/ep_direct.c; moe_rt.h moe_rt_ep_direct_*) in a planning context: the
launches (kernel, grid, block, every argument) equal those moe_rt/_ep_direct.py DirectTransport and
moe_rt/_ep_rows.py computed with their own launch set-ups before they moved to the core (their formulas,
transcribed below from DirectTransport.barrier / chunk_rows / dispatch / combine / copy_rows / row_map / _push /
_recv_buf / forward / reduce and _ep_rows.fill_rows / fill_outputs / slot_values / Fp8Rows.sink), for exact and
capacity mode, bf16/fp32/fp16 rows, one-pass FP8 dispatch (codes and scales, dequantized), zero_empty_slots on
and off, several pair capacities (chunk counts), T = 0 and odd T, a node narrower than the group; and bad input
through the C ABI gets an error status with a message, never a crash."""
from __future__ import annotations

import ctypes as C

import pytest

from moe_rt import _core, _handle

OP = {"dispatch": 1, "combine": 2, "dispatch_bwd": 3, "combine_bwd": 4, "close": 5, "prepare": 6}
CTYPE = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}
ISZ = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}
UNITS = {16: "uint4", 8: "uint2", 4: "unsigned", 2: "unsigned short", 1: "unsigned char"}
BAR, FLAGS, STATE, ERR = 0x1000, 0x2000, 0x3000, 0x4000  # made-up addresses
HANDLE = 1 << 36
TIMEOUT = 10**9


def cdiv(a, b):
    return -(-a // b)


def unit(rb, *ptrs):
    m = rb | 16
    for p in ptrs:
        m |= p
    return m & -m


class Group:
    """A core direct group on a planning context with made-up addresses, and the launches the Python side made."""

    def __init__(self, R=2, me=1, lo=0, hi=None, Pmax=64, sm_count=4, per_sm=2):
        self.R, self.me, self.lo, self.hi = R, me, lo, R if hi is None else hi
        self.Pmax, self.sm, self.resident = Pmax, sm_count, sm_count * per_sm
        self.ctx = _core.planning(sm_count=sm_count, assumed_regs=65536 // (512 * per_sm) // 8 * 8)
        self.g = _core.ep_direct_group_create(self.ctx, R, me, self.lo, self.hi, Pmax, TIMEOUT, BAR, FLAGS, STATE,
                                              ERR)
        self.stages = {}

    def stage(self, rb, K, align=16):
        """A stage pair (as DirectTransport.stages made and registered it): (rows local, rows table, w local,
        w table, the unit of every rank's stage address)."""
        key = (rb, K)
        if key not in self.stages:
            i = len(self.stages) + 1
            s = self.stages[key] = (i << 28, (i << 28) + 0x100, (i << 28) + 0x1000000, (i << 28) + 0x200, align)
            self.g.add_stage(rb, K, align, s[0], s[1], s[2], s[3])
        return self.stages[key]

    def plan(self):
        return [(l[1], l[2], l[3], self.ctx.last_plan_args(i)) for i, l in enumerate(self.ctx.last_plan())]

    # -- the Python side's launches (the formulas of moe_rt/_ep_direct.py and _ep_rows.py before the move) -------
    def barrier(self, op):
        return ("ep_direct_barrier", 1, max(32, cdiv(self.hi - self.lo, 32) * 32),
                [BAR, self.R, self.me, STATE, TIMEOUT, ERR, OP[op], self.lo, self.hi])

    def chunk_rows(self, P):
        c = max(512 // 32, cdiv(P * max(1, self.hi - self.lo - 1), 4 * 2 * 132))
        return max(1, min(32, P, c))

    def copy(self, src, src_map, dst, rows, rb):
        u = unit(rb, src, dst)
        units = rb // u
        return (f"ep_copy_rows<{UNITS[u]}>", max(1, min(rows, self.sm * 16)), min(512, max(32, cdiv(units, 32) * 32)),
                [src, src_map, dst, 0, STATE, rows, units])

    def fill(self, h, out, rb, pp, pv):
        N = h.N
        if N == 0 or (out is None and pp is None):
            return []
        rb = rb if out is not None else 0
        u = unit(rb, out) if out is not None else 16
        return [(f"ep_fill_rows<{UNITS[u]}>", max(1, min(cdiv(N, 8), self.sm * 16)), 256,
                 [out or 0, pp or 0, pv or 0, h.region("src_slot"), N, rb // u])]

    def dispatch(self, h, op, x, rb, w, outs, fp8, out_dtype=None, H=None, *, fill=True, zero=True, out_w=None,
                 recv_buf=None, row_map=None, make_map=False, barrier=True, with_w=None, tpe=0, scale=None):
        """DirectTransport._push (+ dispatch, row_map, copy_rows, _recv_buf) and forward's fill_outputs.
        ``outs``: None (no expand) or the output addresses (one, or codes and scales); ``with_w``: whether
        weights travel (None: when ``w`` is given; a rank without tokens passes none but receives them).
        ``scale``: combine_bwd's weighted rows of that dtype: the RowScale sink where the rows are 16-byte units,
        else _ep_rows.scale_rows' ep_scale_rows launch after the kernel (over out_w, laid out by the kernel)."""
        with_w = bool(w) if with_w is None else with_w
        st = self.stage(rb, h.K)
        # where the dispatch kernel runs (rb > 0) it writes the empty rows' zeros, recv_wk, the laid-out weights
        # (their empty rows' zeros too: the zero items) and tokens_per_expert: no ep_copy_rows of the weights,
        # no ep_fill_rows, no memcpy
        zero_rows = bool(fill and outs is not None and outs[0] and zero and rb and h.N)
        lay_w = bool(fill and out_w)
        zero_items = (zero_rows or lay_w) and h.N > 0
        want = [self.barrier(op)] if barrier else []
        if rb:
            if fp8 is None:
                o = (outs[0] if outs else 0, 0, 0)
                u = min(unit(rb, x, o[0]), st[4])
                name = f"ep_direct_dispatch<{UNITS[u]}, 8>"
                if scale and u == 16:
                    name = f"ep_direct_dispatch<uint4, 8, RowScale<{CTYPE[scale]}>>"
            else:
                u = min(unit(rb, x), st[4])
                assert u == 16
                S, at = cdiv(H, 128), cdiv(H, 4) * 4
                piece = next(g for g in (16, 4, 1) if H % g == 0 and at % g == 0 and (4 * S) % g == 0)
                isz = 1 if fp8 == "codes" else ISZ[out_dtype]
                gp = next(g for g in (16, 4, 1) if g <= piece and all(p % min(16, g * isz) == 0 for p in outs))
                sink = f"Fp8Rows<{gp}>" if fp8 == "codes" else f"Fp8Dequant<{CTYPE[out_dtype]}, {gp}>"
                name = f"ep_direct_dispatch<uint4, 8, {sink}>"
                o = (outs[0], outs[1] if len(outs) > 1 else 0, H)
            C_ = self.chunk_rows(h.P)
            grid = max(1, min(cdiv(h.P, C_) * (self.hi - self.lo), self.resident))
            want.append((name, grid, 512, [x, w or 0, st[1], st[3], FLAGS, h.region("send_tok"), h.region("meta"),
                                           h.region("dst_row"), *o,
                                           h.region("src_slot") if zero_items else 0, h.N if zero_items else 0,
                                           int(zero_rows), h.region("recv_wk") if with_w or lay_w else 0,
                                           int(with_w), out_w if lay_w else 0, h.region("tokens_per_expert"), tpe, h.L,
                                           STATE, ERR, TIMEOUT, OP[op], self.R, self.me,
                                           h.P, h.K, C_, rb // u, self.lo, self.hi]))
        smap = row_map if h.exact else 0
        if h.exact and make_map and h.rows:
            want.append(("ep_direct_row_map", max(1, min(cdiv(h.rows, 256), self.sm * 8)), 256,
                         [h.region("meta"), self.R, h.P, h.rows, row_map]))
        if with_w and h.rows and not rb:
            want.append(self.copy(st[2], smap, h.region("recv_wk"), h.rows, 4 * h.K))
        if recv_buf and h.exact and h.rows and rb:
            want.append(self.copy(st[0], smap, recv_buf, h.rows, rb))
        if fill and outs is not None and not rb:
            pv = h.region("recv_wk") if out_w else None
            if not zero:
                want += self.fill(h, None, 0, out_w, pv)
            elif fp8 is None:
                want += self.fill(h, outs[0], rb, out_w, pv)
            elif fp8 == "codes":
                want += self.fill(h, outs[0], H, out_w, pv) + self.fill(h, outs[1], 4 * cdiv(H, 128), None, None)
            else:
                want += self.fill(h, outs[0], H * ISZ[out_dtype], out_w, pv)
        if scale and rb and h.N and min(unit(rb, x, outs[0]), st[4]) != 16:
            isz, n = ISZ[scale], h.N
            vec = (rb % 16 == 0) and outs[0] % 16 == 0
            Hs = rb // isz
            want.append((f"ep_scale_rows<{CTYPE[scale]}, {'true' if vec else 'false'}>", max(1, min(n, self.sm * 8)),
                         int(min(512, max(32, cdiv(Hs // (16 // isz if vec else 1), 32) * 32))),
                         [outs[0], out_w, n, Hs]))
        return want

    def combine(self, h, op, y, dtype, H, w, gw, zw, out, grad_w, *, barrier=True):
        """DirectTransport.reduce (slot_values, barrier, combine)."""
        st = self.stage(H * ISZ[dtype], h.K)
        want = []
        n = h.rows * h.K
        if gw is not None and n:
            want.append(("ep_slot_values", max(1, min(cdiv(n, 256), self.sm * 8)), 256,
                         [gw if h.N else 0, h.region("dst_row"), zw, n]))
        if barrier:
            want.append(self.barrier(op))
        yp = y if h.N * H else 0
        vec = (H * ISZ[dtype]) % 16 == 0 and yp % 16 == 0 and out % 16 == 0 and st[4] == 16
        C_ = self.chunk_rows(h.P)
        work = max(cdiv(h.P, C_) * (self.hi - self.lo), cdiv(h.T, 16))
        want.append((f"ep_direct_combine<{CTYPE[dtype]}, {'true' if vec else 'false'}>",
                     max(1, min(work, self.resident)), 512,
                     [yp, w or 0, zw or 0, st[1], st[3], FLAGS, h.region("dst_row"), h.region("send_pos"),
                      h.region("routing"), h.region("meta"), out, grad_w or 0, STATE, ERR, TIMEOUT, OP[op], self.R,
                      self.me, h.P, h.K, h.L, h.Tmax, h.T, C_, H, self.lo, self.hi]))
        return want


class Handle:
    def __init__(self, R, L, Tmax, K, P, rows, N, T, exact):
        self.R, self.L, self.Tmax, self.K, self.P, self.rows, self.N, self.T = R, L, Tmax, K, P, rows, N, T
        self.exact = exact
        self.lay = _handle.layout(R, L, Tmax, K, P, rows, N)[0]

    def region(self, name):
        return HANDLE + self.lay[name][0]

    def tup(self):
        return (HANDLE, self.R, self.L, self.Tmax, self.K, self.P, self.rows, self.N, self.T, int(self.exact))


def handle_of(g, exact, T, K=3, L=3, Tmax=13, P=None):
    P = (Tmax if exact else min(g.Pmax, 9)) if P is None else P
    rows = min(g.R * P, T * g.R // 2 + 1) if exact else g.R * P
    N = rows * K // 2 + 5 if T else (0 if exact else L * 4)
    return Handle(g.R, L, Tmax, K, P, rows, N, T, exact)


def dispatch(g, h, op, x, rb, w, *, fp8=0, out_dtype=0, hidden=0, out=0, out_s=0, out_w=0, fill=1, zero=1,
             recv_buf=0, row_map=0, make=0, barrier=1, with_w=None, scale=0):
    g.stage(rb, h.K)
    _core.ep_direct_dispatch(g.g, OP[op], h.tup(), x, rb, w, fp8, out_dtype, hidden, out, out_s, out_w, fill, zero,
                             recv_buf, row_map, make, barrier, 7, int(bool(w)) if with_w is None else with_w, 0,
                             scale)
    return g.plan()


XP, WP, OUT, OUTS, OUTW, RBUF, MAP = 0x81000, 0x82000, 0x83000, 0x84000, 0x85000, 0x86000, 0x87000


@pytest.mark.parametrize("dtype,H", [("bfloat16", 40), ("float32", 7), ("float16", 256), ("bfloat16", 7168)])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("T", [0, 7, 13])
@pytest.mark.parametrize("zero", [True, False])
def test_dispatch_launches_equal_the_python_sides(dtype, H, exact, T, zero):
    for R, me, lo, hi, Pmax in ((2, 1, 0, 2, 64), (4, 2, 2, 4, 2048), (3, 0, 0, 3, 500)):
        g = Group(R=R, me=me, lo=lo, hi=hi, Pmax=Pmax)
        for P in (None, 1, Pmax):
            h = handle_of(g, exact, T, P=P)
            rb = H * ISZ[dtype]
            for shift, w, want_w, make in ((0, WP, True, 1), (2, 0, False, 0), (8, WP, False, 0)):
                got = dispatch(g, h, "dispatch", XP + shift, rb, w, out=OUT + shift, out_w=OUTW if want_w else 0,
                               zero=int(zero), row_map=MAP if exact else 0, make=make)
                want = g.dispatch(h, "dispatch", XP + shift, rb, w, (OUT + shift,), None, zero=zero,
                                  out_w=OUTW if want_w else None, row_map=MAP, make_map=bool(make))
                assert got == want, (R, P, shift)
            # combine_bwd's dispatch direction: no weights; expanded, or the received rows (no expand)
            got = dispatch(g, h, "combine_bwd", XP, rb, 0, out=OUT, out_w=OUTW, row_map=MAP if exact else 0)
            assert got == g.dispatch(h, "combine_bwd", XP, rb, 0, (OUT,), None, out_w=OUTW, row_map=MAP)
            # weighted without y: the rows scaled by the sink (16-byte units) or by ep_scale_rows after the kernel
            # (rows or addresses not 16-byte aligned: XP + 2, or 7 fp32 channels)
            code = {"float32": 0, "float16": 1, "bfloat16": 2}[dtype]
            for shift in (0, 2):
                got = dispatch(g, h, "combine_bwd", XP + shift, rb, 0, out=OUT, out_w=OUTW, out_dtype=code, scale=1,
                               row_map=MAP if exact else 0)
                assert got == g.dispatch(h, "combine_bwd", XP + shift, rb, 0, (OUT,), None, out_w=OUTW, row_map=MAP,
                                         scale=dtype), shift
            got = dispatch(g, h, "combine_bwd", XP, rb, 0, fill=0, recv_buf=RBUF if exact else 0,
                           row_map=MAP if exact else 0)
            assert got == g.dispatch(h, "combine_bwd", XP, rb, 0, None, None, fill=False, recv_buf=RBUF,
                                     row_map=MAP)
            # the mixed transport's direct pass: no fill (its own after the NCCL pass)
            got = dispatch(g, h, "dispatch", XP, rb, WP, out=OUT, fill=0, row_map=MAP if exact else 0)
            assert got == g.dispatch(h, "dispatch", XP, rb, WP, (OUT,), None, fill=False, row_map=MAP)


@pytest.mark.parametrize("exact", [True, False])
def test_a_rank_without_tokens_still_receives_the_weights(exact):
    # T = 0: the rank's w [0,K] has no address, yet its peers push weights to it: with_w = 1 gives the dispatch
    # kernel recv_wk (it copies the stage's weights there and lays out out_w, as with tokens); with_w = 0 does
    # neither
    g = Group(R=4, me=1)
    h = handle_of(g, exact, 0, P=5)
    h.rows, h.N = 6, 9  # received rows from the peers (a handle of a rank without tokens of its own)
    h.lay = _handle.layout(h.R, h.L, h.Tmax, h.K, h.P, h.rows, h.N)[0]
    rb = 80
    for with_w in (1, 0):
        got = dispatch(g, h, "dispatch", 0, rb, 0, out=OUT, out_w=OUTW if with_w else 0,
                       row_map=MAP if exact else 0, make=1, with_w=with_w)
        want = g.dispatch(h, "dispatch", 0, rb, 0, (OUT,), None, out_w=OUTW if with_w else None, row_map=MAP,
                          make_map=True, with_w=bool(with_w))
        assert got == want
        names = [n for n, *_ in got]
        assert not any(n.startswith(("ep_copy_rows", "ep_fill_rows")) for n in names), names
        disp = next(a for n, _, _, a in got if n.startswith("ep_direct_dispatch"))
        assert (disp[14] != 0, disp[15], disp[16]) == (bool(with_w),) * 2 + (OUTW if with_w else 0,)


@pytest.mark.parametrize("H", [7168, 40, 7, 129])
@pytest.mark.parametrize("sink", ["codes", "bfloat16", "float32", "float16"])
@pytest.mark.parametrize("exact,T", [(True, 13), (False, 7), (True, 0)])
def test_fp8_one_pass_dispatch_launches_equal_the_python_sides(H, sink, exact, T):
    g = Group(R=4, me=3)
    h = handle_of(g, exact, T)
    S, at = cdiv(H, 128), cdiv(H, 4) * 4
    rb = cdiv(at + 4 * S, 16) * 16
    codes = sink == "codes"
    for shift, zero, want_w in ((0, True, True), (4, True, False), (2, False, True), (1, True, True)):
        if shift % ISZ.get(sink, 1):
            continue
        outs = (OUT + shift, OUTS + shift) if codes else (OUT + shift,)
        got = dispatch(g, h, "dispatch", XP, rb, WP, fp8=1 if codes else 2,
                       out_dtype=0 if codes else _core.DTYPE_CODES[sink], hidden=H, out=outs[0],
                       out_s=outs[1] if codes else 0, out_w=OUTW if want_w else 0, zero=int(zero),
                       row_map=MAP if exact else 0, make=1)
        want = g.dispatch(h, "dispatch", XP, rb, WP, outs, "codes" if codes else "dequant",
                          None if codes else sink, H, zero=zero, out_w=OUTW if want_w else None, row_map=MAP,
                          make_map=True)
        assert got == want, shift


@pytest.mark.parametrize("dtype,H", [("bfloat16", 40), ("float32", 7), ("bfloat16", 7168), ("float16", 3)])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("T", [0, 5, 13])
def test_combine_and_dispatch_bwd_launches_equal_the_python_sides(dtype, H, exact, T):
    for R, me, lo, hi, Pmax, sm, per_sm in ((2, 1, 0, 2, 64, 4, 2), (4, 0, 0, 2, 1024, 132, 4),
                                            (3, 2, 0, 3, 200, 132, 1)):
        g = Group(R=R, me=me, lo=lo, hi=hi, Pmax=Pmax, sm_count=sm, per_sm=per_sm)
        for P in (None, 1, Pmax):
            h = handle_of(g, exact, T, P=P)
            g.stage(H * ISZ[dtype], h.K)
            for shift in (0, 2):
                y, w, out, gw, zw, gwt = 0x91000 + shift, 0x92000, 0x93000, 0x94000, 0x95000, 0x96000
                _core.ep_direct_combine(g.g, OP["combine"], h.tup(), y, _core.DTYPE_CODES[dtype], H, w, 0, 0, out, 0,
                                        1, 7)
                assert g.plan() == g.combine(h, "combine", y, dtype, H, w, None, None, out, None)
                _core.ep_direct_combine(g.g, OP["combine"], h.tup(), y, _core.DTYPE_CODES[dtype], H, 0, 0, 0, out, 0,
                                        1, 7)
                assert g.plan() == g.combine(h, "combine", y, dtype, H, None, None, None, out, None)
                _core.ep_direct_combine(g.g, OP["dispatch_bwd"], h.tup(), y, _core.DTYPE_CODES[dtype], H, 0, gw, zw,
                                        out, gwt, 1, 7)
                assert g.plan() == g.combine(h, "dispatch_bwd", y, dtype, H, None, gw, zw, out, gwt)
                # the mixed transport's direct kernel: its own slot values and barrier before the NCCL pass
                _core.ep_direct_combine(g.g, OP["dispatch_bwd"], h.tup(), y, _core.DTYPE_CODES[dtype], H, 0, 0, zw,
                                        out, gwt, 0, 7)
                assert g.plan() == g.combine(h, "dispatch_bwd", y, dtype, H, None, None, zw, out, gwt, barrier=False)


def test_barrier_and_unaligned_stages():
    g = Group(R=4, me=1, lo=0, hi=2)
    for op in OP:
        _core.ep_direct_barrier(g.g, OP[op], 7)
        assert g.plan() == [g.barrier(op)]
    h = handle_of(g, False, 5)
    g.stage(80, 3, align=8)  # a stage whose peers' addresses are only 8-byte aligned
    assert dispatch(g, h, "dispatch", XP, 80, 0, out=OUT) == g.dispatch(h, "dispatch", XP, 80, 0, (OUT,), None)
    assert "uint2" in g.plan()[1][0]
    g.stage(80, 3)
    _core.ep_direct_combine(g.g, OP["combine"], h.tup(), 0x91000, _core.DTYPE_CODES["bfloat16"], 40, 0, 0, 0, OUT, 0,
                            1, 7)
    assert g.plan() == g.combine(h, "combine", 0x91000, "bfloat16", 40, None, None, None, OUT, None)
    assert "false" in g.plan()[-1][0]


def test_topk_up_to_the_groups_limit():
    """EpGroup allows topk up to 1024 (docs/ep.md §6): the core's direct group takes it; 1025 is refused."""
    g = Group()
    h = handle_of(g, False, 5, K=1024)
    assert dispatch(g, h, "dispatch", XP, 80, WP, out=OUT) == g.dispatch(h, "dispatch", XP, 80, WP, (OUT,), None)
    with pytest.raises(ValueError, match=r"stage.topk must be in \[1, 1024\], got 1025"):
        g.g.add_stage(80, 1025, 16, 1, 1, 1, 1)
    t = list(h.tup())
    t[4] = 1025
    with pytest.raises(ValueError, match=r"topk in \[1, 1024\]"):
        _core.ep_direct_dispatch(g.g, 1, tuple(t), XP, 80, WP, 0, 0, 0, OUT, 0, 0, 1, 1, 0, 0, 0, 1, 7, 1)


def test_plans_are_cached_per_signature_and_follow_the_call():
    g = Group()
    for T in (3, 11, 0, 3):
        h = handle_of(g, False, T)
        for x in (XP, XP + 16):
            assert dispatch(g, h, "dispatch", x, 80, WP, out=OUT) == g.dispatch(h, "dispatch", x, 80, WP, (OUT,), None)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("T", [0, 7])
def test_dispatch_copies_tokens_per_expert_after_its_launches(exact, T):
    """An output for tokens_per_expert (dispatch's third result) goes to the dispatch kernel (tpe_out: its block 0
    copies the handle's counts there), the launches otherwise as they are (with rows of no bytes the core copies
    them after the launches instead: a device-to-device copy, which a planning context does not record); only
    the dispatch op takes it."""
    g = Group()
    h = handle_of(g, exact, T)
    g.stage(80, h.K)
    TPE = 0x88000
    for with_tpe in (0, TPE, 0):
        _core.ep_direct_dispatch(g.g, OP["dispatch"], h.tup(), XP, 80, WP, 0, 0, 0, OUT, 0, OUTW, 1, 1, 0,
                                 MAP if exact else 0, 0, 1, 7, 1, with_tpe)
        got = g.plan()
        assert got == g.dispatch(h, "dispatch", XP, 80, WP, (OUT,), None, out_w=OUTW, row_map=MAP,
                                 tpe=with_tpe), with_tpe
    with pytest.raises(ValueError, match="outputs->tokens_per_expert is copied only by MOE_RT_EP_OP_DISPATCH"):
        _core.ep_direct_dispatch(g.g, OP["combine_bwd"], h.tup(), XP, 80, 0, 0, 0, 0, OUT, 0, 0, 1, 1, 0,
                                 MAP if exact else 0, 0, 1, 7, 0, TPE)


# -- bad input through the C ABI ----------------------------------------------------------------------------

def test_bad_calls_get_error_statuses_with_messages():
    g = Group()
    h = handle_of(g, True, 7)
    g.stage(80, 3)
    good = dict(x=XP, rb=80, w=WP, out=OUT, row_map=MAP)
    dispatch(g, h, "dispatch", **good)

    def bad(msg, handle=h, op="dispatch", **kw):
        a = dict(good, **kw)
        x, rb, w = a.pop("x"), a.pop("rb"), a.pop("w")
        o = dict(fp8=0, out_dtype=0, hidden=0, out=0, out_s=0, out_w=0, fill=1, zero=1, recv_buf=0, row_map=0,
                 make=0, barrier=1)
        with_w = a.pop("with_w", int(bool(w)))
        scale = a.pop("scale", 0)
        o.update(a)
        with pytest.raises(ValueError, match=msg):
            _core.ep_direct_dispatch(g.g, OP[op], handle.tup(), x, rb, w, *o.values(), 7, with_w, 0, scale)

    bad("op must be MOE_RT_EP_OP_DISPATCH", op="combine")
    bad("no stage pair for 96-byte rows and topk=3", rb=96)
    bad("x is NULL", x=0)
    bad("outputs->row_map is NULL", row_map=0)
    bad("outputs->fp8 must be 0, 1 or 2", fp8=3)
    bad("outputs->zero must be 0 or 1", zero=2)
    bad("barrier must be 0 or 1", barrier=5)
    bad("recv_buf and outputs->out exclude each other", recv_buf=RBUF)
    bad("weights travel only with MOE_RT_EP_OP_DISPATCH", op="combine_bwd")
    bad("weights travel only with MOE_RT_EP_OP_DISPATCH", op="combine_bwd", w=0, with_w=1)
    bad("w is given but outputs->with_w is 0", with_w=0)
    bad(r"outputs->with_w is 1 but w is NULL \(T = 7\)", w=0, with_w=1)
    bad("outputs->with_w must be 0 or 1", with_w=2)
    bad("outputs->out_dtype: expected float32", fp8=2, out_dtype=3, hidden=40)
    bad("outputs->scale must be 0 or 1", scale=2)
    bad("outputs->scale needs MOE_RT_EP_OP_COMBINE_BWD", scale=1, out_w=OUTW, out_dtype=2)  # op dispatch
    for kw in (dict(fill=0), dict(out_w=0), dict(fp8=1, out_s=OUTS, hidden=40)):
        bad("outputs->scale needs MOE_RT_EP_OP_COMBINE_BWD", op="combine_bwd", w=0, scale=1, out_dtype=2,
            **dict(dict(out_w=OUTW), **kw))
    bad(r"outputs->out_dtype \(scale\): expected float32, float16 or bfloat16, got int32",
        op="combine_bwd", w=0, scale=1, out_w=OUTW, out_dtype=3)
    bad("row_bytes 78 is not a whole number of float32 elements", op="combine_bwd", w=0, scale=1, out_w=OUTW,
        out_dtype=0, rb=78)
    bad("packed rows of a multiple of 16 bytes", fp8=1, out_s=OUTS, hidden=0)
    for tup_i, v, msg in ((1, 3, "handle->desc.num_ranks must be the group's 2, got 3"),
                          (5, 65, r"pair_capacity must be in \[1, 64\], got 65"),
                          (8, 14, r"num_tokens must be in \[0, max_tokens_per_rank=13\], got 14"),
                          (0, 0, "handle->buffer is NULL"), (9, 2, "handle->exact must be 0 or 1"),
                          (6, 10**6, "recv_rows must be in")):
        t = list(h.tup())
        t[tup_i] = v
        with pytest.raises(ValueError, match=msg):
            _core.ep_direct_dispatch(g.g, 1, tuple(t), XP, 80, WP, 0, 0, 0, OUT, 0, 0, 1, 1, 0, MAP, 0, 1, 7, 1)
    with pytest.raises(ValueError, match="op must be MOE_RT_EP_OP_COMBINE"):
        _core.ep_direct_combine(g.g, 1, h.tup(), 0x91000, 2, 40, 0, 0, 0, OUT, 0, 1, 7)
    with pytest.raises(ValueError, match="slot_grads and grad_w come together"):
        _core.ep_direct_combine(g.g, 3, h.tup(), 0x91000, 2, 40, 0, 0x94000, 0x95000, OUT, 0, 1, 7)
    with pytest.raises(ValueError, match="dtype: expected float32"):
        _core.ep_direct_combine(g.g, 2, h.tup(), 0x91000, 3, 40, 0, 0, 0, OUT, 0, 1, 7)
    with pytest.raises(ValueError, match="out is NULL"):
        _core.ep_direct_combine(g.g, 2, h.tup(), 0x91000, 2, 40, 0, 0, 0, 0, 0, 1, 7)
    with pytest.raises(ValueError, match="op must be in"):
        _core.ep_direct_barrier(g.g, 7, 7)
    with pytest.raises(ValueError, match="stage.align must be"):
        g.g.add_stage(64, 3, 3, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="stage.peer_w is NULL"):
        g.g.add_stage(64, 3, 16, 1, 1, 1, 0)
    g.g.destroy()
    with pytest.raises(ValueError, match="destroyed"):
        dispatch(g, h, "dispatch", **dict(good, rb=80))


@pytest.mark.parametrize("field,value,msg", [
    (1, 0, "desc.num_ranks must be in"), (2, 2, r"desc.rank must be in \[0, 2\), got 2"),
    (3, 2, "node_lo <= rank"), (4, 1, "node_lo <= rank"), (5, 0, "desc.pair_rows must be >= 1"),
    (6, 0, "desc.timeout_ns must be > 0"), (7, 0, "desc.peer_barrier is NULL"), (8, 0, "desc.peer_flags is NULL"),
    (9, 0, "desc.barrier_state is NULL"), (9, STATE + 4, "desc.barrier_state must be 8-byte aligned"),
    (10, 0, "desc.timeout_word is NULL")])
def test_bad_group_descriptions_are_refused(field, value, msg):
    args = [_core.planning(), 2, 1, 0, 2, 64, TIMEOUT, BAR, FLAGS, STATE, ERR]
    args[field] = value
    with pytest.raises(ValueError, match=msg):
        _core.ep_direct_group_create(*args)


def test_null_group_and_desc_through_the_c_abi():
    """The functions themselves (no Python wrapper in between): NULL group, handle, outputs, desc, out."""
    lib = C.CDLL(_core.LIB_PATH)
    lib.moe_rt_last_error.restype = C.c_char_p
    P = C.c_void_p
    lib.moe_rt_ep_direct_dispatch.argtypes = [P, C.c_int, P, P, C.c_int64, P, P, C.c_int, P]
    lib.moe_rt_ep_direct_combine.argtypes = [P, C.c_int, P, P, C.c_int, C.c_int64, P, P, P, P, P, C.c_int, P]
    lib.moe_rt_ep_direct_barrier.argtypes = [P, C.c_int, P]
    lib.moe_rt_ep_direct_group_create.argtypes = [P, P, P]
    lib.moe_rt_ep_direct_add_stage.argtypes = [P, P]
    lib.moe_rt_ep_direct_group_destroy.argtypes = [P]
    assert lib.moe_rt_ep_direct_dispatch(None, 1, None, 1, 16, None, None, 1, None) == 1
    assert b"moe_rt_ep_direct_dispatch: group is NULL" in lib.moe_rt_last_error()
    assert lib.moe_rt_ep_direct_combine(None, 2, None, 1, 2, 8, None, None, None, 1, None, 1, None) == 1
    assert b"moe_rt_ep_direct_combine: group is NULL" in lib.moe_rt_last_error()
    assert lib.moe_rt_ep_direct_barrier(None, 1, None) == 1 and b"group is NULL" in lib.moe_rt_last_error()
    assert lib.moe_rt_ep_direct_add_stage(None, None) == 1 and b"group is NULL" in lib.moe_rt_last_error()
    out = P(1)
    assert lib.moe_rt_ep_direct_group_create(None, None, C.byref(out)) == 1
    assert b"ctx is NULL" in lib.moe_rt_last_error()
    lib.moe_rt_context_create_planning.argtypes = [P, P]
    info = (C.c_int32 * 6)(132, 228 * 1024, 227 * 1024, 9, 0, 0)
    ctx = P()
    assert lib.moe_rt_context_create_planning(info, C.byref(ctx)) == 0
    assert lib.moe_rt_ep_direct_group_create(ctx, None, C.byref(out)) == 1 and out.value is None
    assert b"desc is NULL" in lib.moe_rt_last_error()
    assert lib.moe_rt_ep_direct_group_create(ctx, None, None) == 1 and b"out is NULL" in lib.moe_rt_last_error()
    # a real group from a desc built here: NULL handle and outputs
    desc = (C.c_int32 * 5)(2, 1, 0, 2, 64)
    tail = b"".join(a.to_bytes(8, "little") for a in (TIMEOUT, BAR, FLAGS, STATE, ERR))
    blob = C.create_string_buffer(bytes(desc) + bytes(4) + tail)  # 4 bytes of padding before timeout_ns
    gp = P()
    assert lib.moe_rt_ep_direct_group_create(ctx, blob, C.byref(gp)) == 0, lib.moe_rt_last_error()
    assert lib.moe_rt_ep_direct_dispatch(gp, 1, None, 1, 16, None, None, 1, None) == 1
    assert b"handle is NULL" in lib.moe_rt_last_error()
    assert lib.moe_rt_ep_direct_add_stage(gp, None) == 1 and b"stage is NULL" in lib.moe_rt_last_error()
    lib.moe_rt_ep_direct_group_destroy(gp)
    lib.moe_rt_ep_direct_group_destroy(None)
    lib.moe_rt_context_destroy.argtypes = [P]
    lib.moe_rt_context_destroy(ctx)
