"""Benchmark of dispatch/combine on one GPU: moe_rt kernels against torch eager and torch.compile.

For each shape (T tokens, E experts, top-K, H=7168 bf16) it times make_plan, dispatch (with probs),
combine (with probs), dispatch_backward and combine_backward (with probs), and the same steps written the
way MaxText / Megatron do in torch (stable argsort + index_select / index_add_). Bytes counted are the
minimum each op must move (e.g. dispatch reads T*H and writes N*H elements); the copy bandwidth is a
device-to-device copy measured in the same run.

    python tools/bench_permutation.py [--quick] [--json PATH] [--no-compile] [--profile PATH]

--profile writes a cProfile of the host side of each op (where per-call time goes). The kernel choices are
the C core's (csrc/permutation.c).
"""
from __future__ import annotations

import json
import sys

import numpy as np

from moe_rt.bench import _lib as benchlib  # noqa: E402

COLUMNS = ["op", "T", "E", "K", "H", "ms", "GB/s", "% copy", "torch ms", "x torch", "compile ms", "x compile"]


def torch_baselines(T, E, K, H):
    """The torch steps a user writes (stable argsort + gathers + index_add_), each taking the previous
    step's outputs."""
    import torch

    def plan(idx):
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        tok = torch.div(order, K, rounding_mode="floor")
        return order, tok, counts

    def dispatch(x, probs, order, tok):
        return x.index_select(0, tok), probs.reshape(-1).index_select(0, order)

    def combine(y_p, probs_p, tok):
        out = torch.zeros(T, H, dtype=y_p.dtype, device=y_p.device)
        return out.index_add_(0, tok, y_p * probs_p.to(y_p.dtype)[:, None])

    def dispatch_bwd(g_p, tok):
        out = torch.zeros(T, H, dtype=g_p.dtype, device=g_p.device)
        return out.index_add_(0, tok, g_p)

    def combine_bwd(g, y_p, probs_p, order, tok):
        gt = g.index_select(0, tok)
        gyp = gt * probs_p.to(g.dtype)[:, None]
        gw_rows = (y_p.float() * gt.float()).sum(-1)
        gw = torch.empty(T * K, dtype=torch.float32, device=g.device)
        gw[order] = gw_rows
        return gyp, gw.view(T, K)

    return {"plan": plan, "dispatch": dispatch, "combine": combine, "dispatch_bwd": dispatch_bwd,
            "combine_bwd": combine_bwd}


def _profile(ops, path, label, calls=200):
    """cProfile of ``calls`` back-to-back calls of each op (host side), appended to ``path``."""
    import cProfile
    import io
    import pstats

    import cupy

    with open(path, "a") as f:
        for op, fn in ops.items():
            fn()
            cupy.cuda.Device().synchronize()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(calls):
                fn()
            pr.disable()
            cupy.cuda.Device().synchronize()
            buf = io.StringIO()
            st = pstats.Stats(pr, stream=buf)
            st.sort_stats("tottime").print_stats(30)
            f.write(f"==== {op} ({label}), {calls} calls\n{buf.getvalue()}\n")


def main(argv=None):
    ap = benchlib.parser(__doc__.splitlines()[0])
    ap.add_argument("--profile", help="write a cProfile (host side, per op) to this file")
    ap.add_argument("--batch", type=benchlib.positive_int, default=8,
                    help="calls per timed region (time reported per call): host launch overhead then "
                         "overlaps the previous call's GPU work, as in a real layer; 1 = isolated calls")
    args = ap.parse_args(argv)
    benchlib.require_gpu(ap.prog)
    import cupy
    import torch

    import moe_rt.permutation as P
    from moe_rt import _jit

    dev = cupy.cuda.Device().id
    props = _jit.device_properties(dev)
    copy_gbs = benchlib.copy_bandwidth()
    table = benchlib.Table("moe_rt dispatch/combine, bf16", COLUMNS)
    table.meta["copy GB/s"] = round(copy_gbs, 1)
    table.meta["combine config"] = str(P._COMBINE_CFG)
    table.meta["timing"] = (f"median of {args.iters} timed regions of {args.batch} back-to-back calls "
                            f"each, per call; inputs rotated over sets exceeding L2")
    table.header()
    H = 7168
    if args.quick:
        shapes = [(8192, 256, 8)]
    else:
        shapes = [(4096, 256, 8), (8192, 256, 8), (32768, 256, 8), (4096, 64, 6), (8192, 64, 6), (32768, 64, 6)]
    compile_at = {8192}  # torch.compile only at the target shape: compiling costs tens of seconds per op
    b = 2
    benchlib.progress_start("permutation", len(shapes))
    for T, E, K in shapes:
        N = T * K
        g = torch.Generator(device="cuda").manual_seed(T + E)
        idx = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :K].to(torch.int32).contiguous()
        probs = torch.rand(T, K, device="cuda", generator=g)
        nset = benchlib.num_copies(N * H * b, props["l2_bytes"])
        xs = [torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(nset)]
        yps = [torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(nset)]
        gpps = [torch.randn(N, device="cuda", generator=g) for _ in range(nset)]
        plan = P.make_plan(idx, E)
        nx, ny = benchlib.rotating(xs), benchlib.rotating(list(zip(yps, gpps)))
        it = dict(iters=args.iters, warmup=args.warmup)

        ours = {
            "make_plan": lambda: P.make_plan(idx, E),
            "dispatch": lambda: P.dispatch(nx(), plan, probs),
            "combine": lambda: P.combine(ny()[0], plan, probs),
            "dispatch_backward": lambda: (lambda a: P.dispatch_backward(a[0], plan, a[1]))(ny()),
            "combine_backward": lambda: P.combine_backward(nx(), plan, ny()[0], probs),
        }
        tb = torch_baselines(T, E, K, H)
        idx64 = idx.long()
        order, tok, _ = tb["plan"](idx64)
        pp = probs.reshape(-1)[order]

        def eager_fns(f):
            return {
                "make_plan": lambda: f["plan"](idx64),
                "dispatch": lambda: f["dispatch"](nx(), probs, order, tok),
                "combine": lambda: f["combine"](ny()[0], pp, tok),
                "dispatch_backward": lambda: f["dispatch_bwd"](ny()[0], tok),
                "combine_backward": lambda: f["combine_bwd"](nx(), ny()[0], pp, order, tok),
            }

        eager = eager_fns(tb)
        compiled = None
        if not args.no_compile and T in compile_at:
            cf = {k: benchlib.torch_compile_or_none(v, True) for k, v in tb.items()}
            if all(v is not None for v in cf.values()):
                compiled = eager_fns(cf)
        nbytes = {
            "make_plan": T * K * 4 * 2 + N * 4,
            "dispatch": (T + N) * H * b + T * K * 4 + N * 4,
            "combine": (N + T) * H * b + T * K * 4,
            "dispatch_backward": (N + T) * H * b,
            "combine_backward": (T + 2 * N) * H * b + 2 * T * K * 4,
        }
        times, eager_ms = {}, {}
        rep = max(1, args.batch)

        def timed(fn):
            def many():
                for _ in range(rep):
                    fn()
            return benchlib.time_cuda(many, **it) / rep

        if args.profile and (T, E, K) == shapes[0]:
            _profile(ours, args.profile, f"T={T} E={E} K={K} H={H}")
        for op, fn in ours.items():
            ms = timed(fn)
            times[op] = ms
            t_ms = eager_ms[op] = timed(eager[op])
            c_ms = None
            if compiled is not None:
                try:
                    c_ms = timed(compiled[op])
                except Exception as e:  # pragma: no cover - depends on the machine
                    print(f"torch.compile {op} failed: {e}", file=sys.stderr)
            gbs = nbytes[op] / (ms * 1e-3) / 1e9
            table.add(op=op, T=T, E=E, K=K, H=H, ms=ms, **{
                "GB/s": gbs, "% copy": 100 * gbs / copy_gbs, "torch ms": t_ms, "x torch": t_ms / ms,
                "compile ms": c_ms, "x compile": (c_ms / ms) if c_ms else None})
        print(f"  make_plan / dispatch time = {100 * times['make_plan'] / times['dispatch']:.1f}%", flush=True)
        # make_plan on a CuPy array: the same op without the torch DLPack import of the routing.
        idx_cp = cupy.from_dlpack(idx)
        table.add(op="make_plan (CuPy input)", T=T, E=E, K=K, H=H, ms=timed(lambda: P.make_plan(idx_cp, E)))
        # The floor of dispatch (its bytes at copy bandwidth) and the most it could gain over torch eager.
        floor_ms = nbytes["dispatch"] / (copy_gbs * 1e9) * 1e3
        table.add(op="dispatch at copy floor", T=T, E=E, K=K, H=H, ms=floor_ms, **{
            "GB/s": copy_gbs, "% copy": 100.0, "torch ms": eager_ms["dispatch"],
            "x torch": eager_ms["dispatch"] / floor_ms})
        # GPU time of make_plan alone, without host overhead: replay of a captured CUDA graph.
        try:
            cs = cupy.cuda.Stream(non_blocking=True)
            with cs:
                P.make_plan(idx_cp, E, stream=cs)  # warm the pool and the kernel cache
                cs.synchronize()
                cs.begin_capture()
                P.make_plan(idx_cp, E, stream=cs)
                graph = cs.end_capture()
                ms = benchlib.time_cuda(lambda: graph.launch(cs), stream=cs, **it)
            table.add(op="make_plan (graph replay)", T=T, E=E, K=K, H=H, ms=ms)
            print(f"  make_plan GPU time / dispatch time = {100 * ms / times['dispatch']:.1f}%", flush=True)
        except Exception as e:  # pragma: no cover - depends on the machine
            print(f"  make_plan graph capture failed: {e!r}", flush=True)
        if args.json:  # rows so far, in case a later shape does not finish
            with open(args.json, "w") as f:
                json.dump({"meta": table.meta, "rows": table.rows}, f, indent=1)
        del xs, yps, gpps, plan, ours, eager, compiled
        torch.cuda.empty_cache()
        cupy.get_default_memory_pool().free_all_blocks()
        benchlib.progress_advance(f"T={T} E={E} K={K}")
    table.finish(args.json)


if __name__ == "__main__":
    main()
