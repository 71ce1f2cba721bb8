"""The time of dispatch (and combine_backward without probs) in one launch, fill_rows's gather form, against
dispatch_rows then fill_rows, at small and medium sizes.

Each side runs in its own process (MOE_RT_GATHER_ROWS and MOE_RT_GATHER_X_BYTES are read once per process:
rows 0 for the two kernels, both large for one launch at every size here), on bf16 rows of T tokens routed to
K = 8 distinct experts of 64 (seeded). Device time per call with the host hidden behind a spin kernel
(moe_rt.bench.router's time_device: 4 * --iters back-to-back calls, 200 by default, median of 5 batches);
`host us`: a torch call's host time on each side (the mean of 6 * --iters calls back to back). `picked`: what
the library picks by default (one launch up to 65536 rows while x takes at most 16 MiB; docs/permutation.md
§1.5). --quick: T = 16 and 128, H = 1024; --no-compile changes nothing.

    python3 tools/bench_rows.py [--T 16,128,512,1024] [--H 1024,7168] [--json FILE] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_rt

from moe_rt import _xla  # noqa: E402
from moe_rt.bench import _lib as benchlib  # noqa: E402

_ALL = 1 << 30  # the knob's value that sends every size here to one launch
E, K = 64, 8
OPS = ("dispatch", "dispatch probs", "combine_backward")


def _side(T_list, H_list, iters, warmup):
    """This process's rows: (op, T, H, device us, host us) under the knob it was started with."""
    import cupy
    import numpy as np
    import torch

    import moe_rt
    from moe_rt.bench.router import time_device

    rng = np.random.default_rng(0)
    out = []
    for T in T_list:
        idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
        for H in H_list:
            x = torch.randn(T, H, device="cuda").bfloat16()
            w = torch.rand(T, K, device="cuda")
            plan = moe_rt.make_plan(torch.from_dlpack(cupy.asarray(idx)), E)
            xc, wc, cplan = cupy.from_dlpack(x), cupy.from_dlpack(w), moe_rt.make_plan(cupy.asarray(idx), E)

            def calls(x, w, plan):
                return {"dispatch": lambda: moe_rt.dispatch(x, plan),
                        "dispatch probs": lambda: moe_rt.dispatch(x, plan, w),
                        "combine_backward": lambda: moe_rt.combine_backward(x, plan)}

            on_torch, on_cupy = calls(x, w, plan), calls(xc, wc, cplan)  # device time on CuPy's stream, as the spin
            for op in OPS:
                us = time_device(on_cupy[op], iters=4 * iters, warmup=max(1, warmup)) * 1e3
                host = benchlib.host_us_back_to_back(on_torch[op], 6 * iters, warmup, torch.cuda.synchronize)
                out.append((op, T, H, us, host))
    return out


def main(argv=None):
    ap = benchlib.parser(__doc__.split("\n\n")[0], prog="tools/bench_rows.py")
    ap.add_argument("--T", type=benchlib.positive_int_list, default=[16, 128, 512, 1024], help="tokens, a list")
    ap.add_argument("--H", type=benchlib.positive_int_list, default=[1024, 7168], help="hidden sizes, a list")
    ap.add_argument("--side", choices=("one", "two"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.T, a.H = [16, 128], [1024]
    if a.side:
        print(json.dumps(_side(a.T, a.H, a.iters, a.warmup)))
        return 0
    benchlib.require_gpu("tools/bench_rows.py")
    argv = ["--T", ",".join(map(str, a.T)), "--H", ",".join(map(str, a.H)), "--iters", str(a.iters), "--warmup",
            str(a.warmup)]
    big = str(_ALL << 20)
    got = benchlib.run_sides(os.path.abspath(__file__), argv,
                             [("two", {"MOE_RT_GATHER_ROWS": "0", "MOE_RT_GATHER_X_BYTES": big}),
                              ("one", {"MOE_RT_GATHER_ROWS": str(_ALL), "MOE_RT_GATHER_X_BYTES": big})])
    sides = {side: {(op, T, H): (us, host) for op, T, H, us, host in rows} for side, rows in got.items()}
    def picked(op, T, H):  # what the planner picks with the default limits (this process leaves the knob as found)
        kw = dict(dtype=_xla.DTYPE_CODES["bfloat16"], T=T, K=K, E=E, N=T * K, align_size=1, H=H,
                  has_probs=op == "dispatch probs", probs_dtype=_xla.DTYPE_CODES["float32"])
        return "one launch" if len(_xla.planned_kernels(op.split()[0], (9, 0), **kw)) == 1 else "two kernels"

    table = benchlib.Table("dispatch rows: one launch (gather) against two kernels, bf16, E=64, K=8",
                           ["op", "T", "H", "rows", "one launch us", "two kernels us", "x", "picked",
                            "host us one launch", "host us two kernels"])
    table.header()
    for op in OPS:
        for T in a.T:
            for H in a.H:
                (one, h1), (two, h2) = sides["one"][(op, T, H)], sides["two"][(op, T, H)]
                table.add(op=op, T=T, H=H, rows=T * K, **{"one launch us": one, "two kernels us": two, "x": two / one,
                                                          "picked": picked(op, T, H),
                                                          "host us one launch": h1, "host us two kernels": h2})
    table.finish(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
