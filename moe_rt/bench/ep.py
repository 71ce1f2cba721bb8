#!/usr/bin/env python3
"""Benchmark expert-parallel prepare / dispatch / combine on R GPUs (one process each).

    python tools/bench_ep.py [--json FILE] [--quick] [--transport direct|nccl|both]
                                                         # launches itself on MOE_RT_BENCH_EP_NPROC (2) GPUs
    python tools/launch.py -n 4 tools/bench_ep.py ...    # explicitly, on 4

Shapes: T in {512, 4096, 16384} tokens per rank, H=7168 (``--hidden``), bf16, E=256, K=8, uniform random top-k routing.
For each mode (exact; capacity eager; capacity as one CUDA graph of prepare+dispatch+combine) it times
prepare (eager: CUDA-event time and, column host_us, the calling thread's median host time of the call, also
given for dispatch, combine, the round trip and (``--fp8``) the FP8 dispatch;
capacity+graph: "prepare (graph)", prepare alone captured in a graph, its device time), then dispatch, combine and the round trip per transfer configuration (``--chunks``; default
s1 = serial in one part, o2 = overlapped in two parts, 2 = the EpGroup default: two parts, overlapped when
the rank sends at least 64 MiB) of the NCCL transport and the direct peer-memory transport (chunks column
"d"; ``--transport``: direct, nccl or both, the default), and, given in ``--chunks`` as ``m<n>`` (e.g. m1,m2),
the mixed group of nodes of n ranks (``EpGroup(transport="auto", local_size=n)``: peer memory within a node,
NCCL between nodes, one machine run as R/n simulated nodes; n must divide R and every pair within a node have
peer access), optionally the serial path's pieces alone
(``--parts``), and side by side in the same run:

(a) the torch.distributed pipeline a user writes: stable argsort permute (K rows per token), all-to-all of
    per-expert counts, ``.tolist()``, ``all_to_all_single`` with splits, chunk sort to expert-major; and
    the reverse for combine (weighted unpermute);
(b) a raw ``all_to_all_single`` moving the bytes moe_rt puts on the wire (own share excluded);
(c) where every pair has peer access: a CUDA-IPC copy-engine all-to-all of the same bytes (one
    ``cudaMemcpyAsync`` of each peer's share straight into the peer's IPC-mapped buffer, one stream per
    peer): the practical limit of the link (column ipc_ce_ms; x_vs_ipc_ce = ms / ipc_ce_ms).

Capacity mode (eager) adds a row "dispatch (no zero)" after each "dispatch" row: the same dispatch with
``zero_empty_slots=False``, whose expert-major rows past each local expert's filled count are left unwritten
(docs/ep.md §4). The dispatch output holds ``N = capacity = R*T*min(K, L)`` rows, of which a uniform routing
fills about ``T*K``: the A/B of writing ``(N - filled) * 2H`` bytes of zeros, ``(R-1)*T*K*2H`` here (R=4,
T=4096: 1.41 GB per dispatch).

``--fp8`` adds a row "dispatch fp8" after each "dispatch" row (exact and capacity eager, every transfer
configuration, the same T and inputs): :meth:`EpGroup.dispatch` with ``fp8=True`` (quantize on the sending
side, the e4m3 codes and fp32 block scales of a token packed into one row on the wire, one pass of the
transport: ``H + 4*ceil(H/128)`` bytes a row padded to a multiple of 16, instead of ``2H``), and the column
x_vs_bf16 = the bf16 dispatch's time / the FP8 one's (the speedup).

``--mode low_latency`` times :class:`moe_rt.LowLatencyGroup` instead (T=128 by default, the same E, K, H):
dispatch and combine alone, eager and captured alone in a CUDA graph (the graph rows are device time), the
eager round trip (host included) and the round trip as one graph, beside a raw ``all_to_all_single`` of the
rows it moves and the torch pipeline (a). wire_MB counts the token rows sent to other ranks (dispatch: one
per (token, distinct other destination rank), or with ``MOE_RT_LL_DEDUP=0`` one per (token, distinct expert
on another rank), as combine always; :func:`moe_rt.ep_ll.wire_rows`) and the dispatch's routing words
(``(R-1)*T*K*8`` bytes); running it with ``MOE_RT_LL_DEDUP=0`` and ``=1`` gives the A/B of the dispatch's
rows; ``MOE_RT_LL_SYNC=barrier`` (read by every rank's groups; the header's ``sync``) times the ops with a
barrier launch before each instead of the default pairwise synchronisation (docs/ep.md §8). With ``--fp8`` (a group made with ``fp8=True``) it adds "dispatch fp8
(graph)" (``dispatch(x, ..., fp8=True)``: e4m3 codes quantized in the push, ``H + 4*ceil(H/128)`` bytes a
row) and "dispatch fp8 dequant (graph)" (the same, dequantized to bf16 on the receiving side) after
"dispatch (graph)", with x_vs_bf16 = the bf16 dispatch graph's time / the row's. Then "round trip partials
(eager)", "combine partials (graph)" and "round trip partials (graph)" time a second group made with
``combine_partials=True`` on the same inputs (combine pushes one row per (token, rank): its wire_MB counts one
row per (token, distinct other rank holding any of its experts)). ``MOE_RT_LL_TRANSPORT=nccl`` (the header's
``transport``) times the groups on the NCCL transport; wire_MB then counts its fixed-size collectives: every
rank's T rows and routing all-gathered, combine parts of T*K rows (T with partials) to each other rank.

Rank 0 prints the table; ``--json`` writes it. Times are rank 0's CUDA-event medians (ranks are
synchronized before every case).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == HERE:
    del sys.path[0]  # run as a script by the launcher: this folder's modules are not top-level modules

from moe_rt._handle import meta_index  # noqa: E402
from moe_rt.bench import _lib as benchlib  # noqa: E402


def _chunk_list(text: str) -> list[str]:
    """argparse type of --chunks: comma-separated chunk counts >= 1, each optionally prefixed s or o, or m<n>:
    the mixed group of nodes of n >= 1 ranks."""
    out = [c.strip() for c in text.split(",") if c.strip()]
    for c in out:
        n = c[1:] if c[:1] in ("s", "o", "m") else c
        if not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(
                f"expected chunk counts >= 1, each optionally prefixed s or o, or m<n> (nodes of n ranks) "
                f"(e.g. s1,o2,2,m2), got {text!r}")
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one chunk count, got {text!r}")
    return out


def parser(prog: str | None = None):
    ap = benchlib.parser(__doc__, prog=prog)
    ap.add_argument("--tokens", type=benchlib.positive_int_list, default=None,
                    help="comma-separated tokens per rank (default 512,4096,16384; --mode low_latency: 128; "
                         "--quick: 512, or 128)")
    ap.add_argument("--mode", default="normal", choices=("normal", "low_latency"),
                    help="normal: EpGroup's exact and capacity modes; low_latency: LowLatencyGroup "
                         "(max_tokens_per_rank = T): dispatch and combine alone (eager and as a CUDA graph: "
                         "device time), the eager round trip and the graph round trip")
    ap.add_argument("--chunks", type=_chunk_list, default=["s1", "o2", "2"],
                    help="transfer configurations to compare: a chunk count, prefixed 's' for the serial path "
                         "or 'o' for the overlapped one (2 alone is the default EpGroup), or m<n>: the mixed "
                         "group of nodes of n ranks (transport='auto', local_size=n; peer memory within a node, "
                         "NCCL between nodes)")
    ap.add_argument("--transport", default="both", choices=("direct", "nccl", "both"),
                    help="the EP transports to time side by side (direct: chunks column 'd')")
    ap.add_argument("--fp8", action="store_true",
                    help="also time the FP8 dispatch (EpGroup.dispatch(fp8=True): quantize on the sender, e4m3 rows "
                         "and their fp32 block scales on the wire) beside the bf16 one, per mode and transfer "
                         "configuration (exact and capacity eager), with the speedup x_vs_bf16; --mode low_latency: "
                         "'dispatch fp8 (graph)' and 'dispatch fp8 dequant (graph)' beside 'dispatch (graph)'")
    ap.add_argument("--parts", action="store_true",
                    help="also time the serial dispatch/combine's parts alone (pack, NCCL exchange, expand; "
                         "reduce, exchange, owner sum) in exact mode")
    ap.add_argument("--hidden", type=benchlib.positive_int, default=7168,
                    help="hidden size H of the token rows (default 7168)")
    ap.add_argument("--nproc", type=benchlib.positive_int,
                    default=int(os.environ.get("MOE_RT_BENCH_EP_NPROC", "2")),
                    help="ranks (one GPU each) when this script launches itself")
    return ap


def _relaunch(argv, nproc) -> int:
    """Run this file on ``nproc`` local GPUs under the launcher (moe_rt.launch), moe_rt importable."""
    pkg_parent = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkg_parent] + ([os.environ["PYTHONPATH"]]
                                                                      if os.environ.get("PYTHONPATH") else [])))
    cmd = [sys.executable, "-m", "moe_rt.launch", "-n", str(nproc), "--timeout", "1500",
           os.path.abspath(__file__), *argv]
    return subprocess.call(cmd, env=env)


def main(argv=None, prog: str | None = None) -> int:
    """Parse the flags (``--help`` and flag errors never start a rank), check the GPUs, then launch the ranks
    (no ``WORLD_SIZE`` in the environment) or run this rank."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = parser(prog)
    args = ap.parse_args(argv)
    benchlib.require_gpu(ap.prog)
    if "WORLD_SIZE" not in os.environ:
        import cupy as cp

        n = cp.cuda.runtime.getDeviceCount()
        if n < args.nproc:
            sys.stderr.write(f"{ap.prog}: {args.nproc} ranks need {args.nproc} CUDA GPUs, found {n}\n")
            return 2
        return _relaunch(argv, args.nproc)
    if args.mode == "low_latency":
        _rank_low_latency(args)
    else:
        _rank(args)
    return 0


def _init_rank():
    """This rank's device, torch.distributed process group and moe_rt communicator: ``(rank, world, dev,
    comm)``."""
    import cupy as cp
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(dev)
    cp.cuda.Device(dev).use()
    dist.init_process_group("nccl", init_method="file://" + os.environ["MOE_RT_UID_FILE"] + ".torch",
                            rank=rank, world_size=world, device_id=torch.device("cuda", dev))
    from moe_rt.bootstrap import init_communicator

    return rank, world, dev, init_communicator(method="file")


def _torch_pipeline(x, idx, w, E, K, world):
    """(a): the torch.distributed pipeline a user writes, as ``(dispatch(), combine(state, y))``: stable argsort
    permute, all-to-all of per-expert counts, ``.tolist()``, ``all_to_all_single`` with splits, chunk sort to
    expert-major; the reverse for combine (weighted unpermute)."""
    import torch
    import torch.distributed as dist

    T, H, L = int(x.shape[0]), int(x.shape[1]), E // world

    def torch_dispatch():
        flat = idx.view(-1).long()
        order = torch.argsort(flat, stable=True)
        xp = x.index_select(0, order // K)
        counts = torch.bincount(flat, minlength=E)
        rcounts = torch.empty_like(counts)
        dist.all_to_all_single(rcounts, counts)
        send = counts.view(world, L).sum(1).tolist()
        rmat = rcounts.view(world, L)
        recv = rmat.sum(1).tolist()
        rx = torch.empty(sum(recv), H, dtype=x.dtype, device="cuda")
        dist.all_to_all_single(rx, xp, recv, send)
        chunks = torch.split(rx, rmat.reshape(-1).tolist())
        em = torch.cat([chunks[s * L + l_] for l_ in range(L) for s in range(world)])
        return em, order, send, recv, rmat

    def torch_combine(st, y):
        em, order, send, recv, rmat = st
        sizes = rmat.t().reshape(-1).tolist()
        chunks = torch.split(y, sizes)
        src_major = torch.cat([chunks[l_ * world + s] for s in range(world) for l_ in range(L)])
        back = torch.empty(T * K, H, dtype=y.dtype, device="cuda")
        dist.all_to_all_single(back, src_major, send, recv)
        un = torch.empty_like(back)
        un[order] = back
        return (un.view(T, K, H).float() * w.unsqueeze(-1)).sum(1).to(y.dtype)

    return torch_dispatch, torch_combine


def _finish(barrier, rank, table, args, comm):
    """Every rank done: rank 0 prints (and writes) the table; the communicators close."""
    import torch.distributed as dist

    barrier()
    if rank == 0:
        table.finish(args.json)
    comm.close()
    dist.destroy_process_group()


def _rank(args):
    import cupy as cp
    import numpy as np
    import torch
    import torch.distributed as dist

    from moe_rt.ep import EpGroup
    from moe_rt.fp8 import packed_layout

    rank, world, dev, comm = _init_rank()
    E, K, H = 256, 8, args.hidden
    Ts = [512] if args.quick else (args.tokens or [512, 4096, 16384])
    from moe_rt import _ep_direct

    peer_ok = world > 1 and _ep_direct.probe_peers(comm, dev, lambda s: s.synchronize())[0]
    chunk_counts = list(args.chunks) if args.transport != "direct" else [c for c in args.chunks if c[:1] == "m"]
    if args.transport != "nccl":
        if not peer_ok:
            raise SystemExit("--transport direct: some pair of ranks has no peer access")
        chunk_counts = ["d"] + chunk_counts
    for c in chunk_counts:
        if c[:1] == "m" and world % int(c[1:]):
            raise SystemExit(f"--chunks {c}: nodes of {c[1:]} ranks must divide the {world} ranks")

    def cfg(c):
        if c == "d":
            return {"transport": "direct"}
        if c[:1] == "m":
            return {"transport": "auto", "local_size": int(c[1:])}
        return {"chunks": int(c.lstrip("so")), "overlap": {"s": False, "o": True}.get(c[:1]), "transport": "nccl"}

    def check_transport(c, grp):
        """An m<n> column is the mixed group (the direct transport for n = R), never a silent NCCL fallback."""
        if c[:1] == "m":
            want = "mixed" if int(c[1:]) < world else "direct"
            if grp.transport != want:
                raise SystemExit(f"--chunks {c}: the group chose transport {grp.transport!r}, not {want!r} "
                                 "(some pair of ranks within a node has no peer access)")
    iters, warm = args.iters, args.warmup
    table = benchlib.Table("EP dispatch/combine (moe_rt vs torch.distributed)",
                           ["op", "mode", "chunks", "T", "ms", "host_us", "wire_MB", "wire_GB/s", "torch_ms",
                            "raw_a2a_ms", "ipc_ce_ms", "x_vs_torch", "x_vs_raw", "x_vs_ipc_ce"]
                           + (["x_vs_bf16"] if args.fp8 else []))
    table.meta.update(ranks=world, experts=E, topk=K, hidden=H, dtype="bfloat16")
    if rank == 0:
        table.header()
    bar = torch.zeros(1, device="cuda")

    def barrier():
        torch.cuda.synchronize()
        dist.all_reduce(bar)
        torch.cuda.synchronize()

    def timed(fn):
        barrier()
        return benchlib.time_cuda(fn, iters=iters, warmup=warm)

    def host_timed(fn):
        barrier()
        return benchlib.time_host(fn, iters=iters, warmup=warm)

    def serial_parts(T, x, w, idx, y, wire, wire_w, t_raw):
        """The serial path's pieces timed alone (exact mode): where dispatch and combine spend their time."""
        from moe_rt import _arrays, _ep_rows, permutation

        gs = EpGroup(comm, E, H, T, mode="exact", overlap=False, transport="nccl")
        nt = gs._transport  # the NCCL transport's pieces
        hp = gs.prepare(idx)
        gs.dispatch(hp, x, w)
        out = []
        with _arrays.Call({"x": x, "w": w, "y": y}) as call:
            xv, wv, yv, s = call["x"], call["w"], call["y"], call.stream
            rb, sb, rbuf, sw, rw_ = nt._forward_buffers(call, hp, xv, wv)
            sc, so, rc, ro = nt._host_counts(hp)
            plan, pw = _ep_rows.plan_view(hp), _ep_rows.recv_wk(hp)
            out.append(("dispatch: pack", timed(lambda: nt._pack(call, hp, xv, wv, sb, rbuf, sw, rw_, 0)), 0, t_raw))
            out.append(("dispatch: NCCL exchange", timed(lambda: nt._exchange(s, rb, K, (sb, sw, sc, so),
                                                                               (rbuf, rw_, rc, ro))),
                        wire + wire_w, t_raw))
            out.append(("dispatch: expand", timed(lambda: permutation.dispatch(rbuf, plan, pw, stream=s)), 0, t_raw))
            z = permutation.combine(yv, plan, pw, stream=s)
            back = call.xp.empty((int(sb.shape[0]), H), z.dtype)
            out.append(("combine: reduce", timed(lambda: permutation.combine(yv, plan, pw, stream=s)), 0, t_raw))
            out.append(("combine: NCCL exchange", timed(lambda: nt._exchange(s, rb, K, (z, None, rc, ro),
                                                                              (back, None, sc, so))), wire, t_raw))
            out.append(("combine: owner sum", timed(lambda: nt._owner_sum(call, hp, z, 0, None, back, None, T,
                                                                          z.dtype, False)), 0, t_raw))
        return [(op, "s1", ms, nb, None, raw, None, None) for op, ms, nb, raw in out]

    def ipc_copy_engine(T, per_peer, grp):
        """(c): every rank copies ``per_peer`` bf16 rows to each peer's IPC buffer (slot ``rank`` of T rows)
        with one cudaMemcpyAsync per peer, each on its own stream; the time of this rank's copies. The buffers'
        exchange waits with ``grp``'s deadline (an EpGroup on the same communicator)."""
        if not peer_ok:
            return None
        rb = H * 2
        wait = _ep_direct.Wait(grp, "ipc_copy_engine_setup")  # a timeout's message names the row's set-up
        dst = _ep_direct._Shared(comm, world * T * rb, cp.cuda.get_current_stream(), wait)
        src = cp.empty(max(per_peer, 1) * rb, cp.uint8)
        streams = [cp.cuda.Stream(non_blocking=True) for _ in range(world)]
        fork, joins = cp.cuda.Event(disable_timing=True), [cp.cuda.Event(disable_timing=True) for _ in range(world)]
        rt = cp.cuda.runtime

        def run():
            main_s = cp.cuda.get_current_stream()
            fork.record(main_s)
            for p in range(world):
                if p == rank or not per_peer:
                    continue
                streams[p].wait_event(fork)
                rt.memcpyAsync(dst.ptrs[p] + rank * T * rb, src.data.ptr, per_peer * rb, rt.memcpyDefault,
                               streams[p].ptr)
                joins[p].record(streams[p])
                main_s.wait_event(joins[p])

        try:
            return timed(run)
        finally:
            cp.cuda.Device().synchronize()
            barrier()  # no peer copies into this rank's buffer any more
            dst.close()

    for T in Ts:
        g_ = torch.Generator(device="cuda").manual_seed(1234 + rank)
        idx = torch.topk(torch.rand(T, E, device="cuda", generator=g_), K, dim=1).indices.to(torch.int32)
        w = torch.rand(T, K, device="cuda", generator=g_)
        x = torch.randn(T, H, device="cuda", generator=g_).to(torch.bfloat16)

        # ---- (a) the torch pipeline ----
        torch_dispatch, torch_combine = _torch_pipeline(x, idx, w, E, K, world)

        st = torch_dispatch()
        t_tdisp = timed(torch_dispatch)
        t_tcomb = timed(lambda: torch_combine(st, st[0]))
        t_trt = timed(lambda: torch_combine(torch_dispatch(), st[0]))

        for mode in ("exact", "capacity", "capacity+graph"):
            m = "capacity" if mode.startswith("capacity") else "exact"
            grps = [EpGroup(comm, E, H, T, mode=m, **cfg(c)) for c in chunk_counts]
            for c, grp in zip(chunk_counts, grps):
                check_transport(c, grp)
            hs = [g.prepare(idx) for g in grps]
            rx, rw, tpe = grps[0].dispatch(hs[0], x, w)
            y = rx  # the expert-major layout is the same for every chunk count
            sz = hs[0].sizes
            if m == "exact":
                send_rows = int(hs[0].state["host_meta"][meta_index("send_rows", world)])
            else:
                send_rows = (world - 1) * sz["P"]
            wire = send_rows * H * 2
            wire_w = send_rows * K * 4
            wire_fp8 = send_rows * packed_layout(H)[2]  # packed rows: e4m3 codes and fp32 block scales
            # (b) raw all_to_all_single of the same bytes (own share excluded)
            per_peer = send_rows // max(world - 1, 1)
            splits = [0 if p == rank else per_peer for p in range(world)]
            a2a_in = torch.empty(sum(splits), H, dtype=torch.bfloat16, device="cuda")
            a2a_out = torch.empty_like(a2a_in)

            def raw():
                dist.all_to_all_single(a2a_out, a2a_in, splits, splits)

            t_raw = timed(raw)
            t_ce = ipc_copy_engine(T, per_peer, grps[0])
            rows = []
            if args.parts and mode == "exact":
                rows += serial_parts(T, x, w, idx, rx, wire, wire_w, t_raw)
            if mode == "capacity+graph":
                xs, ws, ids = cp.from_dlpack(x), cp.from_dlpack(w), cp.from_dlpack(idx)  # DLPack: CAI has no bf16
                seen = set()
                for c, grp in zip(chunk_counts, grps):
                    if grp.transport in seen:  # prepare is the same for every chunk configuration
                        continue  # (the mixed group's prepare is the NCCL one's: its row shows it again)
                    seen.add(grp.transport)
                    # prepare alone captured in a graph: its device time, no host work
                    stream = cp.cuda.Stream(non_blocking=True)
                    pool = cp.cuda.MemoryPool()
                    with cp.cuda.using_allocator(pool.malloc), stream:
                        grp.prepare(ids)
                        stream.synchronize()
                        stream.begin_capture()
                        grp.prepare(ids)
                        graph = stream.end_capture()
                    barrier()
                    t_pg = benchlib.time_cuda(lambda: graph.launch(stream), iters=iters, warmup=warm, stream=stream)
                    rows.append(("prepare (graph)", c, t_pg, 0, None, None, None, None))
                    del graph, pool
                for c, grp in zip(chunk_counts, grps):
                    stream = cp.cuda.Stream(non_blocking=True)
                    pool = cp.cuda.MemoryPool()
                    with cp.cuda.using_allocator(pool.malloc), stream:
                        def step():
                            hh = grp.prepare(ids)
                            r, _, _ = grp.dispatch(hh, xs, ws)
                            return grp.combine(hh, r)

                        step()
                        stream.synchronize()
                        stream.begin_capture()
                        step()
                        graph = stream.end_capture()
                    barrier()
                    t_rt = benchlib.time_cuda(lambda: graph.launch(stream), iters=iters, warmup=warm, stream=stream)
                    rows.append(("round trip (graph)", c, t_rt, 2 * (wire + wire_w), t_trt, 2 * t_raw,
                                 2 * t_ce if t_ce else None, None))
                    del graph, pool
            else:
                seen = set()
                for c, grp in zip(chunk_counts, grps):
                    if grp.transport in seen:  # prepare is the same for every chunk configuration
                        continue
                    seen.add(grp.transport)
                    t_prep = timed(lambda: grp.prepare(idx))
                    rows.append(("prepare", c, t_prep, 0, None, None, None, host_timed(lambda: grp.prepare(idx))))
                for op in ("dispatch", "combine", "round trip"):
                    for c, grp, h in zip(chunk_counts, grps, hs):
                        if op == "dispatch":
                            ms = timed(lambda: grp.dispatch(h, x, w))
                            rows.append((op, c, ms, wire + wire_w, t_tdisp, t_raw, t_ce,
                                         host_timed(lambda: grp.dispatch(h, x, w))))
                            if m == "capacity":  # the A/B of the zero rows past each expert's filled count
                                def nz():
                                    return grp.dispatch(h, x, w, zero_empty_slots=False)

                                rows.append(("dispatch (no zero)", c, timed(nz), wire + wire_w, t_tdisp, t_raw, t_ce,
                                             host_timed(nz)))
                            if args.fp8:
                                def d8():
                                    return grp.dispatch(h, x, w, fp8=True)

                                ms8 = timed(d8)
                                rows.append(("dispatch fp8", c, ms8, wire_fp8 + wire_w, t_tdisp, t_raw, t_ce,
                                             host_timed(d8), ms / ms8))
                        elif op == "combine":
                            ms = timed(lambda: grp.combine(h, y))
                            rows.append((op, c, ms, wire, t_tcomb, t_raw, t_ce, host_timed(lambda: grp.combine(h, y))))
                        else:
                            def rt():
                                hh = grp.prepare(idx)
                                r, _, _ = grp.dispatch(hh, x, w)
                                return grp.combine(hh, r)

                            rows.append((op, c, timed(rt), 2 * wire + wire_w, t_trt, 2 * t_raw,
                                         2 * t_ce if t_ce else None, host_timed(rt)))
            if rank == 0:
                for op, c, ms, nbytes, tms, rawms, cems, hus, *vs_bf16 in rows:
                    table.add(op=op, mode=mode, chunks=c, T=T, ms=ms, host_us=hus, wire_MB=nbytes / 1e6,
                              **{"wire_GB/s": (nbytes / (ms * 1e-3) / 1e9) if nbytes else None},
                              torch_ms=tms, raw_a2a_ms=rawms, ipc_ce_ms=cems,
                              x_vs_torch=(tms / ms) if tms else None, x_vs_raw=(ms / rawms) if rawms else None,
                              x_vs_ipc_ce=(ms / cems) if cems else None,
                              **({"x_vs_bf16": vs_bf16[0] if vs_bf16 else None} if args.fp8 else {}))
            for g in grps:
                g.close()  # a collective with the direct transport: every rank, in the same order
            h = grp = None
            del hs, grps, rx, rw, y, a2a_in, a2a_out
            cp.get_default_memory_pool().free_all_blocks()
        del st
        torch.cuda.empty_cache()
    _finish(barrier, rank, table, args, comm)


def _rank_low_latency(args):
    """--mode low_latency: LowLatencyGroup's rows (module notes)."""
    import cupy as cp
    import torch
    import torch.distributed as dist

    from moe_rt.ep_ll import LowLatencyGroup, env_dedup, env_sync, wire_rows

    dedup = env_dedup()  # MOE_RT_LL_DEDUP: the A/B of the dispatch's rows on the wire
    sync = env_sync()  # MOE_RT_LL_SYNC: the groups below read it themselves (barrier or pairwise)
    rank, world, _, comm = _init_rank()
    E, K, H = 256, 8, args.hidden
    Ts = [128] if args.quick else (args.tokens or [128])
    iters, warm = args.iters, args.warmup
    table = benchlib.Table("EP low-latency dispatch/combine (moe_rt LowLatencyGroup vs torch.distributed)",
                           ["op", "T", "us", "wire_MB", "wire_GB/s", "raw_a2a_us", "torch_us", "x_vs_torch"]
                           + (["x_vs_bf16"] if args.fp8 else []))
    table.meta.update(ranks=world, experts=E, topk=K, hidden=H, dtype="bfloat16", mode="low_latency", dedup=dedup,
                      sync=sync)
    if rank == 0:
        table.header()
    bar = torch.zeros(1, device="cuda")

    def barrier():
        torch.cuda.synchronize()
        cp.cuda.Device().synchronize()
        dist.all_reduce(bar)
        torch.cuda.synchronize()

    def timed(fn, stream=None):
        barrier()
        return 1e3 * benchlib.time_cuda(fn, iters=iters, warmup=warm, stream=stream)

    for T in Ts:
        g_ = torch.Generator(device="cuda").manual_seed(1234 + rank)
        idx_t = torch.topk(torch.rand(T, E, device="cuda", generator=g_), K, dim=1).indices.to(torch.int32)
        w_t = torch.rand(T, K, device="cuda", generator=g_)
        x_t = torch.randn(T, H, device="cuda", generator=g_).to(torch.bfloat16)
        torch.cuda.synchronize()
        x, w, idx = cp.from_dlpack(x_t), cp.from_dlpack(w_t), cp.from_dlpack(idx_t)
        # rows this rank pushes to other ranks: combine one per (token, distinct expert on another rank);
        # dispatch the same without dedup, else one per (token, distinct other destination rank)
        e = idx_t.long().cpu().numpy()
        remote = wire_rows(e, E, world, rank, dedup=False)
        sent = wire_rows(e, E, world, rank, dedup=dedup)
        wire = remote * H * 2  # combine
        wire_d = sent * H * 2  # dispatch
        wire_fp8 = sent * (H + 4 * -(-H // 128))  # e4m3 codes and their fp32 block scales
        meta = (world - 1) * T * K * 8  # each (t, k)'s local expert (int32) and weight (fp32) to every other rank

        # the torch pipeline (a) and a raw all_to_all_single of the same rows
        torch_dispatch, torch_combine = _torch_pipeline(x_t, idx_t, w_t, E, K, world)
        st = torch_dispatch()

        def raw_a2a(rows):
            per_peer = -(-rows // max(world - 1, 1))
            splits = [0 if p == rank else per_peer for p in range(world)]
            a2a_in = torch.empty(sum(splits), H, dtype=torch.bfloat16, device="cuda")
            a2a_out = torch.empty_like(a2a_in)
            return timed(lambda: dist.all_to_all_single(a2a_out, a2a_in, splits, splits))

        t_raw = raw_a2a(remote)
        t_raw_d = raw_a2a(sent) if sent != remote else t_raw
        t_torch = timed(lambda: torch_combine(torch_dispatch(), st[0]))

        g = LowLatencyGroup(comm, E, H, T, topk=K, dtype="bfloat16", fp8=args.fp8, dedup=dedup)
        stream = cp.cuda.Stream(non_blocking=True)
        rows = []
        with stream:
            recv, counts, h = g.dispatch(x, idx, w)
            table.meta.update(transport=g.transport)
            if g.transport == "nccl":  # fixed-size collectives: what each rank sends to the others
                peers = world - 1
                meta = peers * (4 + 2 * T * K) * 4  # the routing all-gathered
                wire_d = peers * T * H * 2  # every token row all-gathered
                wire_fp8 = peers * T * (H + 4 * -(-H // 128))
                wire = peers * T * K * H * 2  # combine: a part of Tmax*K rows to each owner
            y = recv.copy()  # the expert stand-in: identity
            g.combine(h, y)
            g.synchronize()
            rows.append(("dispatch (eager)", timed(lambda: g.dispatch(x, idx, w), stream), wire_d + meta,
                         t_raw_d, None))
            rows.append(("combine (eager)", timed(lambda: g.combine(h, y), stream), wire, t_raw, None))
            rows.append(("round trip (eager)", timed(lambda: g.combine(g.dispatch(x, idx, w)[2], y), stream),
                         wire_d + wire, t_raw_d + t_raw, t_torch))
            graphs = {}
            captured = [("dispatch (graph)", lambda: g.dispatch(x, idx, w)),
                        ("combine (graph)", lambda: g.combine(h, y)),
                        ("round trip (graph)", lambda: g.combine(g.dispatch(x, idx, w)[2], y))]
            if args.fp8:
                ext = torch.cuda.ExternalStream(stream.ptr)

                def fp8_dispatch():  # torch arrays (CuPy holds no float8_e4m3fn), on the capturing stream
                    with torch.cuda.stream(ext):
                        return g.dispatch(x_t, idx_t, w_t, fp8=True)

                captured += [("dispatch fp8 (graph)", fp8_dispatch),
                             ("dispatch fp8 dequant (graph)",
                              lambda: g.dispatch(x, idx, w, fp8=True, dequantize=True))]
            for name, fn in captured:
                fn()
                stream.synchronize()
                stream.begin_capture()
                keep = fn()
                graphs[name] = (stream.end_capture(), keep)
            # the split dispatch's halves: the send (barrier + pushes + flags) and, replayed after a send,
            # the receive (its waits find the flags already set: the receive side's own work)
            stream.begin_capture()
            *_, hook = g.dispatch(x, idx, w, return_recv_hook=True)
            graphs["dispatch send (graph)"] = (stream.end_capture(), None)
            stream.begin_capture()
            hook()
            graphs["dispatch receive (graph)"] = (stream.end_capture(), None)
            graphs["dispatch send (graph)"][0].launch(stream)
            fp8_rows = ((("dispatch fp8 (graph)", wire_fp8 + meta, t_raw_d, None),
                         ("dispatch fp8 dequant (graph)", wire_fp8 + meta, t_raw_d, None))
                        if args.fp8 else ())
            for name, nb, raw, tt in ((("dispatch (graph)", wire_d + meta, t_raw_d, None),) + fp8_rows
                                      + (("dispatch send (graph)", wire_d + meta, t_raw_d, None),
                                         ("dispatch receive (graph)", 0, None, None),
                                         ("combine (graph)", wire, t_raw, None),
                                         ("round trip (graph)", wire_d + wire, t_raw_d + t_raw, t_torch))):
                graph = graphs[name][0]
                rows.append((name, timed(lambda: graph.launch(stream), stream), nb, raw, tt))
            g.synchronize()
        # every graph released before the groups and the communicator close: graphs that captured the NCCL
        # transport's collectives hold NCCL resources of the communicator
        del graphs, graph
        barrier()
        g.close()
        # the rank-partial combine: a second group made with combine_partials=True, the same inputs and expert
        # rows; one row per (token, other rank holding any of its experts) comes back
        sent_p = wire_rows(e, E, world, rank, dedup=True)
        wire_p = sent_p * H * 2 if table.meta["transport"] != "nccl" else (world - 1) * T * H * 2
        t_raw_p = raw_a2a(sent_p) if sent_p != remote else t_raw
        gp = LowLatencyGroup(comm, E, H, T, topk=K, dtype="bfloat16", dedup=dedup, combine_partials=True)
        graphs = {}
        with stream:
            _, _, hp = gp.dispatch(x, idx, w)
            # the eager round trip with partials (host included), beside the graph rows below
            rows.append(("round trip partials (eager)", timed(lambda: gp.combine(gp.dispatch(x, idx, w)[2], y),
                                                              stream), wire_d + wire_p, t_raw_d + t_raw_p, t_torch))
            for name, fn, nb, raw, tt in (
                    ("combine partials (graph)", lambda: gp.combine(hp, y), wire_p, t_raw_p, None),
                    ("round trip partials (graph)", lambda: gp.combine(gp.dispatch(x, idx, w)[2], y),
                     wire_d + wire_p, t_raw_d + t_raw_p, t_torch)):
                fn()
                stream.synchronize()
                stream.begin_capture()
                keep = fn()
                graphs[name] = (stream.end_capture(), keep)
                graph = graphs[name][0]
                rows.append((name, timed(lambda: graph.launch(stream), stream), nb, raw, tt))
            gp.synchronize()
        if rank == 0:
            bf16_graph = next(us for op, us, *_ in rows if op == "dispatch (graph)")
            for op, us, nbytes, raw, tt in rows:
                table.add(op=op, T=T, us=us, wire_MB=nbytes / 1e6,
                          **{"wire_GB/s": (nbytes / (us * 1e-6) / 1e9) if nbytes else None},
                          raw_a2a_us=raw, torch_us=tt, x_vs_torch=(tt / us) if tt else None,
                          **({"x_vs_bf16": bf16_graph / us if op.startswith("dispatch fp8") else None}
                             if args.fp8 else {}))
        # every graph released before the groups and the communicator close: graphs that captured the NCCL
        # transport's collectives hold NCCL resources of the communicator
        del graphs, graph
        barrier()
        gp.close()
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    _finish(barrier, rank, table, args, comm)


if __name__ == "__main__":
    sys.exit(main())
