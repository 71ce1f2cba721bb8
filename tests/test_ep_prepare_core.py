"""EpGroup.prepare's launches in the C core (csrc/ep_prepare.c; moe_rt.h moe_rt_ep_prepare_*) in a planning context:
the launches (kernel, grid, block, shared memory, every argument) equal those moe_rt/ep.py computed with its own set-up
before they moved to the core (its formulas, transcribed below from _PrepCfg, _prep_grid, EpGroup._prepare_cuda and
permutation.plan_config / plan_kernels), for R in 2..8, several L, K, T (0 included), Tmax, align sizes, both id
dtypes, capacity and exact mode, the direct and the NCCL transport, a fused and an unfused received side; and bad
calls through the C ABI get an error status with a message, never a crash."""
from __future__ import annotations

import ctypes as C
import itertools

import numpy as np
import pytest

from moe_rt import _core, _handle
from moe_rt.reference import permutation as _perm_ref

HANDLE = 1 << 36
IDX, PART, GS, ERR, STATE, BOX, INBOX, OUTBOX, BAR, TWORD, WS = (0x10000 * i for i in range(1, 12))
TIMEOUT = 10**9
OP_PREPARE = 6
RECV = ("recv_tok", "recv_local", "dst_row", "src_slot", "seg_start", "expert_counts", "tokens_per_expert")


def cdiv(a, b):
    return -(-a // b)


class Device:
    """The planning context's device: SMs, the opt-in shared memory, the registers assumed of every kernel."""

    def __init__(self, sms=132, optin=227 * 1024, regs=0):
        self.sms, self.optin, self.regs = sms, optin, regs
        self.ctx = _core.planning(sm_count=sms, smem_per_block_optin=optin, assumed_regs=regs)

    def resident(self, threads, smem):
        """Blocks resident at once (the occupancy query EpGroup made, as a planning context models it)."""
        per_sm = max(1, min(2048 // threads, 32, (228 * 1024) // (smem + 1024)))
        if self.regs:
            per_sm = max(1, min(per_sm, 65536 // (threads * (cdiv(self.regs, 8) * 8))))
        return per_sm * self.sms


class Case:
    """One prepare signature and the launches moe_rt/ep.py made for it (the formulas before the move)."""

    def __init__(self, dev, R, me, L, K, Tmax, T, P, A, cap, idx="int32", direct=False, rows=None, slots=None):
        self.dev, self.R, self.me, self.L, self.K, self.Tmax, self.T, self.P, self.A = dev, R, me, L, K, Tmax, T, P, A
        self.cap, self.idx, self.direct = cap, idx, direct
        exact = cap < 0
        self.rows = R * P if not exact else (rows if rows is not None else 0)
        self.slots = slots
        num_out = cap if not exact else slots
        self.N = _perm_ref.num_rows(self.rows, K, L, A, num_out) if (not exact or slots is not None) else 0
        self.CW, self.W = L + 2, 2 * K + 1
        self.SEG = self.CW + P * self.W
        self.half = R * self.SEG if direct else 0
        self.plan_smem = 4 * (2 * R + 1 + R * self.CW + 4 * L + 1)
        self.fused = self.plan_smem <= 40 * 1024
        B = max(1, min(64, cdiv(T, 128)), cdiv(T, 8192))
        per = cdiv(T, B)
        self.TC = max(32, cdiv(per, 32) * 32)
        self.B = max(1, cdiv(T, self.TC))
        room = max(48 * 1024, dev.optin) - 1024
        self.nw = max(1, min(8, (room - 4 * self.TC - 4 * L) // (4 * L)))
        self.send_smem = 4 * (L * (self.nw + 1) + self.TC)  # the warps' counts, the chunk, the chunks-before prefix
        if self.send_smem + 4 * self.TC * (2 * K + 1) <= room:  # the chunk's box rows, staged where they fit
            self.send_smem += 4 * self.TC * (2 * K + 1)
        self.whole = direct and not exact and self.fused
        self.lay, _ = _handle.layout(R, L, Tmax, K, P, self.rows, self.N)

    def desc(self):
        return (self.R, self.me, self.L, self.R * self.L, self.Tmax, self.K, self.P, self.A, self.T, self.cap,
                3 if self.idx == "int32" else 4, int(self.direct), self.rows, self.N,
                self.slots if self.slots is not None else 0)

    def bufs(self, ws=0, ws_bytes=0):
        return (HANDLE, IDX if self.T else 0, PART, GS, ERR, STATE if self.direct else 0, BOX if self.direct else 0,
                INBOX, 0 if self.direct else OUTBOX, BAR if self.direct else 0, TIMEOUT if self.direct else 0,
                TWORD if self.direct else 0, ws, ws_bytes)

    def at(self, region):
        return HANDLE + self.lay[region][0]

    def recv_grid(self, fused, n):
        """_prep_grid: ep_prepare_plan's at most two blocks per SM; ep_prepare_recv's as _ep_rows.grid."""
        sms = self.dev.sms
        if not fused:
            return 0 if n <= 0 else max(1, min(cdiv(n, 256), sms * 8))
        return max(1, min(cdiv(n, 256), 2 * sms))

    def send(self):
        """EpGroup._prepare_cuda's first launch: ep_prepare_direct (the whole prepare) or ep_prepare_send."""
        ctype = "int" if self.idx == "int32" else "long long"
        items, wave = self.R * self.B, 2 * self.dev.sms
        head = [IDX if self.T else 0, self.T, self.Tmax, self.K, self.R * self.L, self.R, self.me, self.L, self.P,
                self.TC, self.B, self.at("routing"), self.at("send_tok"), self.at("send_pos"), self.at("meta")]
        if self.whole:
            smem = max(self.send_smem, self.plan_smem)
            grid = max(1, min(max(items, self.recv_grid(True, max(self.rows, self.N))), wave,
                              self.dev.resident(256, smem)))
            args = head + [STATE, self.half, BOX, ERR, self.nw, PART, GS, BAR, TIMEOUT, TWORD, OP_PREPARE, self.A,
                           self.cap, self.rows, self.N] + [self.at(r) for r in RECV]
            return (f"ep_prepare_direct<{ctype}>", grid, 256, smem, args)
        grid = max(1, min(items, wave, self.dev.resident(256, self.send_smem)))
        if self.direct:
            box = [STATE, self.half, BOX, 0, 0]
        else:
            box = [0, 0, 0, OUTBOX if self.R > 1 else INBOX, INBOX]
        return (f"ep_prepare_send<{ctype}>", grid, 256, self.send_smem, head + box + [ERR, self.nw, PART, GS])

    def segs(self):
        return [INBOX, self.SEG, STATE if self.direct else 0, self.half]

    def meta(self):
        return ("ep_plan_meta", 1, 32, 0, [self.at("meta"), *self.segs(), self.R, self.me, self.P, 1, -1])

    def recv(self, ws=WS):
        """The received side: ep_prepare_plan, or ep_prepare_recv and the permutation plan's three kernels."""
        exact = self.cap < 0
        n = max(self.rows, self.N, self.R * self.P)
        grid = self.recv_grid(self.fused, n)
        common = [self.at("meta"), *self.segs(), self.R, self.me, self.P, self.K, self.L]
        if self.fused:
            return [("ep_prepare_plan", grid, 256, self.plan_smem,
                     common + [self.A, int(exact), self.cap, self.rows, self.N] + [self.at(r) for r in RECV])]
        want = [("ep_prepare_recv", grid, 256, 4 * (2 * self.R + 1),
                 common + [int(exact), self.cap, self.rows, self.at("recv_tok"), self.at("recv_local")])]
        # permutation.plan_config / plan_kernels over recv_local: rows x K slots, L experts
        Ls, E = self.rows * self.K, self.L
        chunk = 256
        while cdiv(Ls, chunk) * E > (4 << 20) and chunk < (1 << 20):
            chunk *= 2
        nch = cdiv(Ls, chunk)
        wpb = max(1, min(8, (48 * 1024) // (4 * E)))
        smem = wpb * 4 * E
        num_out = self.cap if not exact else self.slots
        partial, base = ws, ws + 4 * nch * E
        totals = base + 4 * nch * E
        done = totals + 4 * E
        src, dst = self.at("src_slot"), self.at("dst_row")
        seg, counts, tpe = self.at("seg_start"), self.at("expert_counts"), self.at("tokens_per_expert")
        idx = self.at("recv_local")
        want += [("plan_count<int>", max(cdiv(nch, wpb), 1), 32 * wpb, smem,
                  [idx, Ls, E, chunk, nch, partial, src, self.N, done, ERR]),
                 ("plan_scan", cdiv(E, 32), 1024, 0, [partial, base, totals, nch, E, self.A, num_out, counts, tpe, seg,
                                                      done]),
                 ("plan_assign<int>", cdiv(nch, wpb), 32 * wpb, smem, [idx, Ls, E, chunk, nch, base, counts, seg, dst,
                                                                      src])]
        return want


def core(dev, step, case, ws=0, ws_bytes=0):
    _core.ep_prepare(dev.ctx, step, case.desc(), case.bufs(ws, ws_bytes), 7)
    return [(l[1], l[2], l[3], l[4], dev.ctx.last_plan_args(i)) for i, l in enumerate(dev.ctx.last_plan())]


def norm(launches):
    return [(n, g, b, s, [int(a) for a in args]) for n, g, b, s, args in launches]


def ws_of(case):
    return _core.make_plan_workspace_bytes(case.rows, case.K, case.L) if not case.fused else 0


SHAPES = [  # (R, L, K, Tmax, T, P-in-capacity-mode, A)
    (2, 4, 2, 16, 11, 12, 1), (2, 1, 1, 8, 0, 8, 1), (3, 5, 3, 100, 77, 40, 4), (4, 64, 8, 4096, 4096, 1024, 1),
    (4, 8, 4, 300, 129, 300, 16), (5, 3, 2, 9000, 8193, 3000, 1), (8, 32, 8, 2048, 1000, 512, 8),
    (8, 3000, 2, 64, 63, 32, 1), (2, 9000, 4, 40, 17, 20, 2), (6, 7, 5, 33, 33, 33, 1), (7, 2, 1, 1, 1, 1, 1),
    (8, 16, 6, 200000, 150000, 20000, 1),
    (2, 9000, 2, 20000, 20000, 5000, 1),  # the send side's shared memory holds one block an SM: resident < wave
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("idx", ["int32", "int64"])
def test_capacity_mode_launches_equal_the_python_side(shape, direct, idx):
    """Capacity mode: the send side (ep_prepare_direct, the whole prepare, where the direct transport's received
    side is fused; else ep_prepare_send) and the received side, as EpGroup made them."""
    R, L, K, Tmax, T, P, A = shape
    for dev in (Device(), Device(sms=4, optin=48 * 1024, regs=128), Device(sms=20, regs=64)):
        for me in sorted({0, R - 1}):
            for cap in sorted({R * P * min(K, L), max(1, R * P // 3)}):
                c = Case(dev, R, me, L, K, Tmax, T, P, A, cap, idx, direct)
                sizes = _core.ep_prepare_sizes(c.desc())
                assert sizes == (c.TC, c.B, R * c.B * (L + 1), c.SEG, c.fused, c.whole)
                assert norm(core(dev, 0, c)) == [c.send()]
                if c.whole:
                    with pytest.raises(ValueError, match="one kernel"):
                        core(dev, 2, c)
                    continue
                assert norm(core(dev, 2, c, WS, ws_of(c))) == c.recv()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("direct", [False, True])
def test_exact_mode_launches_equal_the_python_side(shape, direct):
    """Exact mode: the send side, ep_plan_meta (before the host read: the handle's fixed regions), then the
    received side over the handle sized from the counts read (rows, total slots)."""
    R, L, K, Tmax, T, _, A = shape
    dev = Device(sms=16, regs=96)
    rng = np.random.default_rng(R * 1000 + L)
    for idx, me in itertools.product(("int32", "int64"), sorted({0, R // 2})):
        c = Case(dev, R, me, L, K, Tmax, T, Tmax, A, -1, idx, direct)
        assert _core.ep_prepare_sizes(c.desc())[4:] == (c.fused, False)
        assert norm(core(dev, 0, c)) == [c.send()]
        assert norm(core(dev, 1, c)) == [c.meta()]
        for rows in sorted({0, int(rng.integers(0, R * Tmax + 1)), R * Tmax}):
            slots = int(rng.integers(0, rows * K + 1))
            r = Case(dev, R, me, L, K, Tmax, T, Tmax, A, -1, idx, direct, rows=rows, slots=slots)
            assert norm(core(dev, 2, r, WS, ws_of(r))) == r.recv()


def test_plans_are_cached_per_signature():
    """A second call of a signature reuses its plan (the same launches); another T plans anew."""
    dev = Device()
    a = Case(dev, 4, 1, 8, 4, 300, 129, 300, 1, 4800)
    first = core(dev, 0, a)
    assert core(dev, 0, a) == first
    b = Case(dev, 4, 1, 8, 4, 300, 300, 300, 1, 4800)
    assert norm(core(dev, 0, b)) == [b.send()] != norm(first)


def _bad(dev, step, case, msg, desc=None, bufs=None):
    with pytest.raises(ValueError, match=msg):
        _core.ep_prepare(dev.ctx, step, desc or case.desc(), bufs or case.bufs(), 7)


def test_bad_calls_get_error_statuses_with_messages():
    dev = Device()
    c = Case(dev, 4, 1, 8, 4, 300, 129, 300, 1, 4800, direct=True)
    d, b = list(c.desc()), list(c.bufs())

    def with_(seq, i, v):
        s = list(seq)
        s[i] = v
        return tuple(s)

    for i, v, msg in ((0, 0, r"num_ranks must be in \[1, 65536\], got 0"), (1, 4, r"desc->rank must be in \[0, 4\)"),
                      (3, 31, "num_experts must be num_ranks \\* num_local_experts = 4 \\* 8"),
                      (4, 0, "max_tokens_per_rank must be >= 1"), (5, 0, r"topk must be in \[1, 1024\]"),
                      (6, 0, "pair_capacity must be >= 1"), (7, 0, r"align_size must be in \[1, 2\^20\]"),
                      (8, 301, r"num_tokens must be in \[0, max_tokens_per_rank=300\], got 301"),
                      (9, -2, "capacity must be -1"), (10, 5, "idx_dtype: expected MOE_RT_INT32 or MOE_RT_INT64"),
                      (11, 2, "direct must be 0 or 1"), (12, 5, "recv_rows must be num_ranks\\*pair_capacity"),
                      (12, 10**6, r"recv_rows must be in \[0, num_ranks\*pair_capacity=1200\]")):
        _bad(dev, 0, c, msg, desc=with_(d, i, v))
    with pytest.raises(ValueError, match="num_rows must be the plan's 4800 rows, got 4801"):
        _core.ep_prepare(dev.ctx, 0, with_(d, 13, 4801), tuple(b), 7)
    for i, msg in ((0, "bufs->handle is NULL"), (1, "bufs->topk_idx is NULL"), (2, "bufs->part is NULL"),
                   (3, "bufs->grid_sync is NULL"), (5, "bufs->state and bufs->inbox"),
                   (6, "bufs->peer_box"), (9, "needs bufs->peer_barrier"), (11, "needs bufs->peer_barrier")):
        _bad(dev, 0, c, msg, bufs=with_(b, i, 0))
    _bad(dev, 0, c, "16-byte aligned", bufs=with_(b, 0, HANDLE + 4))
    _bad(dev, 1, c, "exact mode only")
    n = Case(dev, 4, 1, 8, 4, 300, 129, 300, 1, 4800)  # NCCL
    _bad(dev, 0, n, "bufs->outbox is NULL", bufs=with_(n.bufs(), 8, 0))
    _bad(dev, 0, n, "bufs->inbox is NULL", bufs=with_(n.bufs(), 7, 0))
    u = Case(dev, 2, 0, 9000, 4, 40, 17, 20, 2, 100)  # unfused: the plan kernels' workspace
    need = ws_of(u)
    _bad(dev, 2, u, f"bufs->workspace: need {need} bytes", bufs=u.bufs(WS, need - 1))
    _bad(dev, 2, u, "(NULL)", bufs=u.bufs(0, need))
    e = Case(dev, 2, 0, 8, 4, 40, 17, 40, 1, -1, rows=30, slots=200)
    _bad(dev, 2, e, r"total_slots must be in \[0, recv_rows\*topk = 120\] in exact mode, got 200")


def test_null_arguments_through_the_c_abi():
    """The functions themselves (no Python wrapper in between): NULL context, desc, buffers, out."""
    lib = C.CDLL(_core.LIB_PATH)
    lib.moe_rt_last_error.restype = C.c_char_p
    P = C.c_void_p
    for name in ("moe_rt_ep_prepare_send", "moe_rt_ep_prepare_meta", "moe_rt_ep_prepare_recv"):
        f = getattr(lib, name)
        f.argtypes = [P, P, P, P]
        assert f(None, None, None, None) == 1
        assert f"{name}: ctx is NULL".encode() in lib.moe_rt_last_error()
    lib.moe_rt_ep_prepare_sizes_of.argtypes = [P, P]
    assert lib.moe_rt_ep_prepare_sizes_of(None, None) == 1 and b"desc is NULL" in lib.moe_rt_last_error()
    lib.moe_rt_context_create_planning.argtypes = [P, P]
    info = (C.c_int32 * 6)(132, 228 * 1024, 227 * 1024, 9, 0, 0)
    ctx = P()
    assert lib.moe_rt_context_create_planning(info, C.byref(ctx)) == 0
    assert lib.moe_rt_ep_prepare_send(ctx, None, None, None) == 1 and b"desc is NULL" in lib.moe_rt_last_error()
    lib.moe_rt_context_destroy.argtypes = [P]
    lib.moe_rt_context_destroy(ctx)
