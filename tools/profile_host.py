"""Host time per call of moe_rt's ops at a small size (launch overhead dominates), and where it goes.

For each op, on torch CUDA tensors, CuPy arrays and through the torch adapter: microseconds of host time per
call (perf_counter over a loop of calls, the device synchronized once at the end; GPU work is far shorter at
this size), then a cProfile of the same loop on torch tensors, the functions with the most own time.

    python tools/profile_host.py [--tokens 128] [--calls 300] [--top 18] [--out FILE]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", nargs="+", metavar="OP",
                    default=["make_plan", "combine", "topk_with_score", "torch adapter topk fwd+bwd"],
                    help="the ops (names as printed) to cProfile")
    a = ap.parse_args()
    import cupy as cp
    import torch

    import moe_rt
    import moe_rt.torch as mt

    T, E, K, H = a.tokens, 64, 8, 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(T, E, device="cuda", generator=g)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    probs, rmap, inter = moe_rt.topk_with_score(logits, K)
    idx = torch.topk(logits, K).indices.int()
    plan = moe_rt.make_plan(idx, E)
    xp, _ = moe_rt.dispatch(x, plan)
    w = torch.rand(T, K, device="cuda")
    scores, smap, sinter = moe_rt.scores_for_aux_loss(logits, K, "softmax")
    tpe = smap.sum(0, dtype=torch.int32)
    gprobs = torch.randn_like(probs)
    c = {k: cp.from_dlpack(v) for k, v in dict(logits=logits, idx=idx, x=x, w=w).items()}
    cplan = moe_rt.make_plan(c["idx"], E)
    cxp, _ = moe_rt.dispatch(c["x"], cplan)
    lg = logits.clone().requires_grad_()
    tplan = mt.make_plan(idx, E)

    def adapter_topk():
        p, _ = mt.topk_with_score(lg, K)
        p.backward(gprobs)

    ops = {
        "make_plan": (lambda: moe_rt.make_plan(idx, E), lambda: moe_rt.make_plan(c["idx"], E)),
        "dispatch": (lambda: moe_rt.dispatch(x, plan), lambda: moe_rt.dispatch(c["x"], cplan)),
        "combine": (lambda: moe_rt.combine(xp, plan, w), lambda: moe_rt.combine(cxp, cplan, c["w"])),
        "topk_with_score": (lambda: moe_rt.topk_with_score(logits, K),
                            lambda: moe_rt.topk_with_score(c["logits"], K)),
        "topk_with_score_backward": (
            lambda: moe_rt.topk_with_score_backward(gprobs, rmap, inter, K, score_function="softmax"), None),
        "scores_for_aux_loss": (lambda: moe_rt.scores_for_aux_loss(logits, K, "softmax"),
                                lambda: moe_rt.scores_for_aux_loss(c["logits"], K, "softmax")),
        "aux_loss": (lambda: moe_rt.aux_loss(scores, tpe, T, E, K, 1e-2), None),
        "dispatch_backward": (lambda: moe_rt.dispatch_backward(xp, plan), None),
        "combine_backward": (lambda: moe_rt.combine_backward(x, plan, xp, w), None),
        "torch adapter make_plan": (lambda: mt.make_plan(idx, E), None),
        "torch adapter dispatch": (lambda: mt.dispatch(x, tplan), None),
        "torch adapter topk fwd+bwd": (adapter_topk, None),
        "torch empty op (x + 0)": (lambda: x.add(0), None),
    }

    def per_call(fn):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / a.calls * 1e6

    lines = [f"host us per call, T={T} E={E} K={K} H={H} ({torch.cuda.get_device_name()})",
             f"{'op':<30} {'torch':>10} {'cupy':>10}"]
    for name, (ft, fc) in ops.items():
        lines.append(f"{name:<30} {per_call(ft):>10.1f} {(per_call(fc) if fc else float('nan')):>10.1f}")
    report = "\n".join(lines)
    print(report, flush=True)
    prof = []
    for name in a.profile:
        fn = ops[name][0]
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
        prof.append(f"==== cProfile {name} ({a.calls} calls), by own time\n" + s.getvalue())
    text = report + "\n\n" + "\n".join(prof)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
