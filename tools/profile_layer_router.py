"""Where the torch router stage of the layer benchmark spends its time: moe_rt against eager torch.

The stage (moe_rt/bench/layer.py: fp32 logits ``x @ w_router``, top-k, aux scores and loss, forward and
backward) timed whole and in parts, each as one step (forward, then ``torch.autograd.grad``):

- ``moe_rt router`` / ``eager router``: the stage as the layer benchmark times it;
- ``moe_rt ops`` / ``eager ops``: the router ops alone on given fp32 logits (no matmul);
- ``matmul only``: the fp32 cast and matmul, forward and backward.

Columns: CUDA events around a step on an idle GPU (as the layer benchmark times it, host launch gaps
included); the step's host time with the GPU idle at its start; the host time a step takes when steps run back
to back; and the GPU's time a step then (wall clock over 20 steps, synchronized at the end). With ``--profile``,
torch.profiler's device time a step per kernel and the host time of the busiest ops, for the first four rows.

    python tools/profile_layer_router.py [--T 8192] [--H 4096] [--E 64] [--K 8] [--profile]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_rt


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("T", 8192), ("H", 4096), ("E", 64), ("K", 8)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of the first four rows")
    a = ap.parse_args(argv)
    if min(a.T, a.H, a.E, a.K, a.iters) < 1 or a.K > a.E:
        ap.error("--T, --H, --E, --K and --iters must be positive, and K <= E")
    return a


def cases(a):
    """(name, step) for each row."""
    import torch

    import moe_rt.torch as mt
    from moe_rt.bench.layer import COEFF, Shape, torch_parts, torch_step

    T, E, K = a.T, a.E, a.K
    P = torch_parts(Shape(T, a.H, E, K, 1408), "loop")  # the router stages only (no experts run)
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16, grad=True):
        t = (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)
        return t.requires_grad_() if grad else t

    x, wr = rnd(T, a.H), rnd(a.H, E, scale=a.H ** -0.5)
    one = torch.ones((), device="cuda")
    g_probs, g_w = rnd(T, E, dtype=torch.float32, grad=False), rnd(T, K, dtype=torch.float32, grad=False)
    logits = (x.detach().float() @ wr.detach().float()).requires_grad_()

    def mr_ops(lg):  # moe_rt_stages' router after the matmul
        probs, rmap = mt.topk_with_score(lg, K, score_function="softmax")
        scores, smap = mt.scores_for_aux_loss(lg, K, "softmax")
        return probs, mt.aux_loss(scores, smap.sum(0, dtype=torch.int32), T, E, K, COEFF), rmap

    def pl_ops(lg):  # torch_parts' pl_router after the matmul
        v, idx = lg.topk(K, dim=-1)
        sc = torch.softmax(lg, -1)
        tpe = torch.zeros_like(sc).scatter(1, sc.topk(K, dim=-1)[1], 1.0).sum(0)
        return torch.softmax(v, -1), E * COEFF / K / T / T * (sc.sum(0) * tpe).sum(), idx

    return [("moe_rt router", torch_step(P["mr_router"], (x, wr), [g_probs, one])),
            ("eager router", torch_step(P["pl_router"], (x, wr), [g_w, one])),
            ("moe_rt ops (logits given)", torch_step(mr_ops, (logits,), [g_probs, one])),
            ("eager ops (logits given)", torch_step(pl_ops, (logits,), [g_w, one])),
            ("matmul only", torch_step(lambda x_, w_: (x_.float() @ w_.float(),), (x, wr), [g_probs]))]


def profile(name, step):
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    n = 5
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    rows = prof.key_averages()
    print(f"\n### {name}: device time a step by kernel (us)")
    total = 0.0
    for e in sorted(rows, key=lambda e: -e.self_device_time_total):
        if e.self_device_time_total > 0:
            total += e.self_device_time_total
            print(f"  {e.self_device_time_total / n:8.1f}  x{e.count // n:<3d} {e.key[:100]}")
    print(f"  {total / n:8.1f}  total")
    print(f"### {name}: host time a step of the busiest ops (us, profiler overhead included)")
    for e in sorted(rows, key=lambda e: -e.cpu_time_total)[:10]:
        print(f"  {e.cpu_time_total / n:8.1f}  x{e.count // n:<3d} {e.key[:100]}")


def main(argv=None):
    a = parse(argv)
    from moe_rt.bench import _lib as benchlib

    benchlib.require_gpu("profile_layer_router.py")
    import torch

    rows = cases(a)
    print(f"T={a.T} H={a.H} E={a.E} K={a.K}, {benchlib.device_name()}, torch {torch.__version__}")
    print("| step | events ms | host us (idle GPU) | host us (back to back) | ms a step (back to back) |")
    print("|---|---|---|---|---|")
    for name, step in rows:
        ms = benchlib.time_cuda(step, iters=a.iters, warmup=10)
        host = benchlib.time_host(step, iters=a.iters, warmup=10)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        enqueue = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 20 * 1e3
        print(f"| {name} | {ms:.3f} | {host:.0f} | {enqueue:.0f} | {wall:.3f} |", flush=True)
    if a.profile:
        for name, step in rows[:4]:
            profile(name, step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
