"""The C core's low-latency ops on the NCCL transport (moe_rt.h moe_rt_ll_group_desc.transport =
MOE_RT_LL_TRANSPORT_NCCL; csrc/ep_ll.c nl_*) in a planning context: each op's launches (kernel, grid, block,
every argument) against the formulas below, for bf16, fp32 and odd rows, FP8 rows, split phases, T = 0, both
buffer sets and rank partials; and the descriptions the transport refuses. The NCCL exchange between the launches
is not recorded by a planning context (the multi-GPU tests run it: tests/ep_ll_worker.py transports)."""
from __future__ import annotations

import pytest

from moe_rt import _core

OP = {"dispatch": 1, "combine": 2, "dispatch_bwd": 3, "combine_bwd": 4}
CTYPE = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}
ISZ = {"float32": 4, "bfloat16": 2, "float16": 2}
BASE = 1 << 40
COMM, ERR = 0x7000, 0x5000
NAMES = ("recv_q", "recv_s", "gather", "gather_meta", "gather_q", "gather_s", "back_send", "back", "bw_send", "bw")
TABLES = (0x71000, 0x72000, 0x73000, 0x74000, 0x75000, 0x76000)  # idx, w, route, slot_k, slot_w, counts


def cdiv(a, b):
    return -(-a // b)


class Group:
    """A core group of the NCCL transport on a planning context, with made-up 256-byte aligned regions."""

    def __init__(self, R=2, me=1, L=3, Tmax=13, K=3, H=40, dtype="bfloat16", num_buffers=2, fp8=False, sm=4,
                 partials=False):
        self.R, self.me, self.L, self.Tmax, self.K, self.H, self.dtype = R, me, L, Tmax, K, H, dtype
        self.fp8, self.partials, self.sm = fp8, partials, sm
        self.S = cdiv(H, 128)
        self.ctx = _core.planning(sm_count=sm)
        self.recv = [BASE * (b + 1) for b in range(num_buffers)]
        self.regions = []
        for b in range(num_buffers):
            r = {n: BASE * (b + 1) + 0x100000 * (i + 1) for i, n in enumerate(NAMES)}
            if not fp8:
                for n in ("recv_q", "recv_s", "gather_q", "gather_s"):
                    r[n] = 0
            self.regions.append(r)
        self.g = _core.ll_group_create(
            self.ctx, R, me, L, Tmax, K, _core.DTYPE_CODES[dtype], H, 1, num_buffers, int(fp8), self.S, 1, 10**9,
            [(self.recv[b], 0, 0, 0, 0, 0, 0, 0) for b in range(num_buffers)], 0, 0, 0, 0, ERR, 0,
            combine_partials=int(partials), sync=1, transport=1, comm=COMM,
            nccl_sets=[tuple(r[n] for n in NAMES) for r in self.regions])

    def plan(self):
        return [(l[1], l[2], l[3], self.ctx.last_plan_args(i)) for i, l in enumerate(self.ctx.last_plan())]

    def unit(self, codes, vec):
        return (16 if vec else 1) if codes else (16 // ISZ[self.dtype] if vec else 1)

    def grid(self, items):
        return max(1, min(cdiv(items, 8), self.sm * 8))

    def sizes(self):
        return [self.R, self.me, self.L, self.Tmax, self.K, self.H]

    def pack(self, b, x, xq, xs, idx, w, T, meta, idx64=False, vec=True, fp8=False):
        r = self.regions[b]
        z = (lambda p: p if T else 0)
        name = (f"ep_ll_nccl_pack<{CTYPE[self.dtype]}, {'long long' if idx64 else 'int'}, "
                f"{'true' if vec else 'false'}, {'true' if fp8 else 'false'}>")
        args = [z(x), z(xq), z(xs), z(idx), z(w), T, meta, z(TABLES[0]) if meta else 0, z(TABLES[1]) if meta else 0,
                TABLES[5] if meta else 0, r["gather"], r["gather_q"], r["gather_s"], r["gather_meta"], ERR]
        return (name, cdiv(self.Tmax, 4), 512, args + self.sizes() + [self.S])

    def expand(self, b, mode, scaled=0):
        r = self.regions[b]
        codes = mode in (1, 2)
        vec = (self.H % 16 == 0) if codes else (self.H * ISZ[self.dtype]) % 16 == 0
        ns = cdiv(self.H // self.unit(codes, vec), 128)
        tables = mode != 3
        args = [r["gather"], r["gather_q"], r["gather_s"], r["gather_meta"], self.recv[b], r["recv_q"], r["recv_s"],
                TABLES[2] if tables else 0, TABLES[3], TABLES[4], TABLES[5] if tables else 0, scaled]
        return (f"ep_ll_nccl_expand<{CTYPE[self.dtype]}, {'true' if vec else 'false'}, {mode}>",
                self.grid(self.R * self.Tmax * ns), 256, args + self.sizes() + [self.S])

    def combine(self, b, op, y, gws, out, grad_w, T):
        r = self.regions[b]
        rows = out is not None or op != "combine_bwd"
        partials = self.partials and op == "combine"
        mode = (2 if partials else 0) if op == "combine" else 1
        vec = (self.H * ISZ[self.dtype]) % 16 == 0 and not ((y or 0) | (out or 0)) & 15
        ns = cdiv(self.H // self.unit(False, vec), 128) if rows else 1
        tf = "true" if vec else "false"
        reduce = (f"ep_ll_nccl_reduce<{CTYPE[self.dtype]}, {tf}, {'true' if partials else 'false'}>",
                  self.grid(self.R * self.Tmax * ns), 256,
                  [y if rows else 0, gws, TABLES[2], TABLES[4] if partials else 0, r["back_send"], r["back"],
                   r["bw_send"], r["bw"], int(rows)] + self.sizes()[:5] + [self.H])
        owner = (f"ep_ll_nccl_owner<{CTYPE[self.dtype]}, {tf}, {mode}>", self.grid(T * ns) if T else 0, 256,
                 [r["back"], r["bw"], TABLES[0] if T else 0, TABLES[1] if mode == 0 and T else 0,
                  (out or 0) if rows and T else 0, grad_w if T else 0, int(rows), T, self.L, self.Tmax, self.K,
                  self.H])
        return [reduce, owner]

    def slot_dot(self, b, y, dots):
        n = self.L * self.R * self.Tmax
        vec = (self.H * ISZ[self.dtype]) % 16 == 0 and not y & 15
        return (f"ep_ll_slot_dot<{CTYPE[self.dtype]}, {'true' if vec else 'false'}>",
                max(1, min(cdiv(n, 8), self.sm * 8)), 256, [self.recv[b], y, TABLES[3], TABLES[4], dots, n, self.H])


@pytest.mark.parametrize("dtype,H", [("bfloat16", 40), ("float32", 7), ("float16", 7168)])
@pytest.mark.parametrize("fp8", [None, "float", "pair", "dequant"])
@pytest.mark.parametrize("T", [0, 7, 13])
@pytest.mark.parametrize("phases", [3, 1, 2])
def test_dispatch_launches(dtype, H, fp8, T, phases):
    """The pack (the push half), then the expand (the receive half): MODE 0 rows, 1 FP8 codes, 2 dequantized."""
    g = Group(H=H, dtype=dtype, fp8=fp8 is not None)
    pair = fp8 == "pair"
    for b, idx64, shift in ((0, False, 0), (1, True, 2), (1, False, 0)):
        x, xq, xs, idx, w = 0x81000 + shift, 0x82000 + shift, 0x83000, 0x84000, 0x85000
        _core.ll_dispatch(g.g, b, phases, 0 if pair else x, xq if pair else 0, xs if pair else 0,
                          int(fp8 is not None), int(fp8 == "dequant"), idx, 4 if idx64 else 3, w, T, TABLES, 7)
        if fp8 is not None:
            vec = H % 16 == 0 and not ((xq if pair else x) & 15 if T else 0)
        else:
            vec = (H * ISZ[dtype]) % 16 == 0 and not (x & 15 if T else 0)
        want = []
        if phases & 1:
            want.append(g.pack(b, 0 if pair else x, xq if pair else 0, xs if pair else 0, idx, w, T, 1, idx64, vec,
                               fp8 is not None))
        if phases & 2:
            want.append(g.expand(b, 0 if fp8 is None else (2 if fp8 == "dequant" else 1)))
        assert g.plan() == want, (b, idx64, shift)


@pytest.mark.parametrize("dtype,H", [("bfloat16", 40), ("float32", 7), ("bfloat16", 7168)])
@pytest.mark.parametrize("T", [0, 5, 13])
@pytest.mark.parametrize("R,Tmax,sm", [(2, 13, 4), (4, 1024, 132), (3, 200, 132)])
@pytest.mark.parametrize("partials", [False, True])
def test_combine_and_backward_launches(dtype, H, T, R, Tmax, sm, partials):
    """The combine direction: ep_ll_nccl_reduce then ep_ll_nccl_owner (MODE 0 weighted, 1 unweighted, 2 rank
    partials: combine_partials changes combine alone); combine_bwd: the pack of grad_out's rows (no routing),
    the expand's MODE 3 (scaled without expert_out) and, with expert_out, the slot dot."""
    g = Group(R=R, me=R - 1, Tmax=Tmax, H=H, dtype=dtype, sm=sm, partials=partials)
    for b, shift in ((0, 0), (1, 2)):
        y, out, gws, gw, gout, dots = 0x91000 + shift, 0x92000, 0x93000, 0x94000, 0x95000 + shift, 0x96000
        _core.ll_combine(g.g, b, OP["combine"], y, 0, TABLES, T, out, 0, 7)
        assert g.plan() == g.combine(b, "combine", y, 0, out, 0, T)
        _core.ll_combine(g.g, b, OP["dispatch_bwd"], y, gws, TABLES, T, out, gw, 7)
        assert g.plan() == g.combine(b, "dispatch_bwd", y, gws, out, gw, T)
        _core.ll_combine(g.g, b, OP["combine_bwd"], 0, dots, TABLES, T, 0, gw, 7)
        assert g.plan() == g.combine(b, "combine_bwd", None, dots, None, gw, T)
        for yk in (None, 0xA1000 + shift):
            _core.ll_combine_bwd(g.g, b, gout, yk or 0, TABLES, T, dots if yk else 0, 7)
            vec = (H * ISZ[dtype]) % 16 == 0 and not (gout & 15 if T else 0)
            want = [g.pack(b, gout, 0, 0, 0, 0, T, 0, vec=vec), g.expand(b, 3, scaled=int(yk is None))]
            if yk:
                want.append(g.slot_dot(b, yk, dots))
            assert g.plan() == want, (b, yk)


def _make(**over):
    """ll_group_create's arguments of a valid 2-rank NCCL group on a planning context, with ``over`` applied."""
    a = dict(R=2, fp8=0, comm=COMM, sets=[(BASE, 0, 0, 0, 0, 0, 0, 0)],
             nccl=[tuple(0 if n in ("recv_q", "recv_s", "gather_q", "gather_s") else BASE + 0x100000 * (i + 1)
                         for i, n in enumerate(NAMES))], transport=1)
    a.update(over)
    return _core.ll_group_create(_core.planning(sm_count=4), a["R"], 0, 3, 13, 3, _core.DTYPE_CODES["bfloat16"], 40,
                                 1, len(a["sets"]), a["fp8"], 1, 1, 10**9, a["sets"], 0, 0, 0, 0, 0, 0, sync=1,
                                 transport=a["transport"], comm=a["comm"], nccl_sets=a["nccl"])


def test_a_valid_description_plans_without_any_direct_field():
    """No peer table, flag, barrier, timeout word or set epoch: the NCCL transport needs none of them."""
    _make()
    _make(R=1, comm=0)  # one rank: no communicator


@pytest.mark.parametrize("over,msg", [
    (dict(comm=0), "desc.comm is NULL"),
    (dict(transport=2), "desc.transport must be"),
    (dict(nccl=[(0,) * 10]), "desc.set[0].gather is NULL"),
    (dict(fp8=1), "desc.set[0].recv_q is NULL (an fp8 group)"),
    (dict(nccl=[tuple(BASE + 0x100000 * (i + 1) for i in range(10))]), "must be NULL when desc.fp8 is 0"),
    (dict(nccl=[tuple(0 if n in ("recv_q", "recv_s", "gather_q", "gather_s") else BASE + 0x100000 * (i + 1)
                      + (8 if n == "back" else 0) for i, n in enumerate(NAMES))]), "desc.set[0].back must be 16-byte"),
])
def test_bad_descriptions_are_refused(over, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        _make(**over)
