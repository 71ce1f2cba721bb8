"""Where an FP8 dispatch's time goes, on the direct transport (issue 32's FP8 target): per call of
EpGroup.dispatch, for the bf16 dispatch, the FP8 dispatch (fp8=True; and with dequantize=True) and a bf16
dispatch of rows of the FP8 rows' bytes (hidden = the packed row's bytes / 2: 3696 for H=7168, what the
transport takes to move and expand those bytes, the FP8 path's floor):

- eager: one call between two CUDA events on an idle device (the calling thread's work until its kernels are
  queued is in it, as in tools/bench_ep.py's rows);
- back-to-back: --batch calls between two events, divided by --batch (the host runs ahead: device time);
- host: the calling thread's median time of one call (the stream synchronized between calls).

Medians of --iters runs; rank 0 prints one table row per (T, mode, case) with x_bf16 = the bf16 dispatch's
time / the case's, eager and back-to-back. E=256, K=8, H=7168 (--hidden), bf16 x, uniform random top-k
routing, torch tensors on torch's stream (the lean call a torch user makes).

    python tools/launch.py -n 4 tools/profile_ep_fp8.py [--tokens 4096,16384] [--iters 30] [--batch 10]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_rt

from moe_rt.bench import _lib as benchlib  # noqa: E402


def parser():
    p = benchlib.ArgumentParser(prog="profile_ep_fp8.py", description=benchlib.plain_text(__doc__),
                                formatter_class=benchlib.HelpFormatter)
    p.add_argument("--tokens", type=benchlib.positive_int_list, default=[4096, 16384],
                   help="comma-separated tokens per rank")
    p.add_argument("--iters", type=benchlib.positive_int, default=30, help="timed runs per case (median)")
    p.add_argument("--batch", type=benchlib.positive_int, default=10, help="calls per back-to-back run")
    p.add_argument("--hidden", type=benchlib.positive_int, default=7168, help="hidden size H")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    benchlib.require_gpu("profile_ep_fp8.py")
    import cupy as cp
    import numpy as np
    import torch
    import torch.distributed as dist

    from moe_rt.bench.ep import _init_rank
    from moe_rt.ep import EpGroup
    from moe_rt.fp8 import packed_layout

    rank, world, _, comm = _init_rank()
    E, K, H = 256, 8, args.hidden
    Hs = packed_layout(H)[2] // 2  # bf16 rows of the packed FP8 rows' bytes
    bar = torch.zeros(1, device="cuda")

    def barrier():
        torch.cuda.synchronize()
        dist.all_reduce(bar)
        torch.cuda.synchronize()

    def back_to_back(fn):
        for _ in range(3):
            fn()
        s = cp.cuda.get_current_stream()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        ts = []
        for _ in range(args.iters):
            barrier()
            a.record(s)
            for _ in range(args.batch):
                fn()
            b.record(s)
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b) / args.batch)
        return float(np.median(ts))

    if rank == 0:
        print("| R | T | mode | case | H | eager ms | back-to-back ms | host us | x_bf16 eager | x_bf16 back-to-back |")
        print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for T in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
        idx = torch.topk(torch.rand(T, E, device="cuda", generator=gen), K, dim=1).indices.to(torch.int32)
        w = torch.rand(T, K, device="cuda", generator=gen)
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        xs = x[:, :Hs].contiguous()
        for mode in ("exact", "capacity"):
            g = EpGroup(comm, E, H, T, mode=mode, transport="direct")
            gs = EpGroup(comm, E, Hs, T, mode=mode, transport="direct")
            h, hs = g.prepare(idx), gs.prepare(idx)
            cases = [("bf16", H, lambda: g.dispatch(h, x, w)),
                     ("bf16, the FP8 rows' bytes", Hs, lambda: gs.dispatch(hs, xs, w)),
                     ("fp8", H, lambda: g.dispatch(h, x, w, fp8=True)),
                     ("fp8, dequantize", H, lambda: g.dispatch(h, x, w, fp8=True, dequantize=True))]
            got = []
            for name, hid, fn in cases:
                barrier()
                eager = benchlib.time_cuda(fn, iters=args.iters, warmup=5)
                barrier()
                b2b = back_to_back(fn)
                barrier()
                host = benchlib.time_host(fn, iters=args.iters, warmup=5)
                got.append((name, hid, eager, b2b, host))
            if rank == 0:
                e0, b0 = got[0][2], got[0][3]
                for name, hid, eager, b2b, host in got:
                    print(f"| {world} | {T} | {mode} | {name} | {hid} | {eager:.3f} | {b2b:.3f} | {host:.0f} | "
                          f"{e0 / eager:.2f} | {b0 / b2b:.2f} |", flush=True)
            h.close()
            hs.close()
            g.close()
            gs.close()
    barrier()
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
