"""The device time of make_plan, one CTA (plan_fused) against the three kernels, at small and medium T.

Each side runs in its own process (MOE_RT_PLAN_FUSED_SLOTS and MOE_RT_PLAN_FUSED_MAP_SLOTS are read once per
process: 0 for the three kernels, a large value for one CTA up to every size here), on CuPy int32 top-k ids
(distinct experts per token, seeded), or with --map on the same routing as a bool routing map [T, E] (T * E
slots; num_out_tokens T * K, as TE's callers pass it). Device time per call with the host hidden behind a spin
kernel (moe_rt.bench.router's time_device: 4 * --iters back-to-back calls, 200 by default, median of 5
batches); `host us`: a torch call's host time on each side (moe_rt.make_plan on a torch tensor, the mean of
6 * --iters calls back to back). --quick: E=64, T=16 and 128; --no-compile changes nothing (no torch.compile
baseline here). `picked`: what the library picks by default (one CTA up to 4096 slots of ids or 8192 of a map
where the counts fit; docs/permutation.md §1.2).

    python3 tools/bench_plan.py [--E 64,256,1024] [--T 16,128,512,1024,2048,4096] [--K 8] [--map] [--json FILE]
                                [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_rt

from moe_rt import _xla  # noqa: E402
from moe_rt.bench import _lib as benchlib  # noqa: E402

_ALL = 1 << 30  # the knob's value that sends every size here to one CTA


def _side(E_list, T_list, K, iters, warmup, as_map=False):
    """This process's rows: (E, T, device us, host us) under the knob it was started with: device time over
    batches of 4 * iters back-to-back calls, host time over 6 * iters, after warmup calls."""
    import cupy
    import numpy as np
    import torch

    import moe_rt
    from moe_rt.bench.router import time_device

    rng = np.random.default_rng(0)
    out = []
    for E in E_list:
        for T in T_list:
            idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
            if as_map:
                m = np.zeros((T, E), bool)
                np.put_along_axis(m, idx, True, axis=1)
                idx = m
            idx = cupy.asarray(idx)
            nout = T * K if as_map else None
            us = time_device(lambda: moe_rt.make_plan(idx, E, num_out_tokens=nout), iters=4 * iters,
                             warmup=max(1, warmup)) * 1e3
            it = torch.from_dlpack(idx)
            host = benchlib.host_us_back_to_back(lambda: moe_rt.make_plan(it, E, num_out_tokens=nout), 6 * iters,
                                                 warmup, torch.cuda.synchronize)
            out.append((E, T, us, host))
    return out


def main(argv=None):
    ap = benchlib.parser(__doc__.split("\n\n")[0], prog="tools/bench_plan.py")
    ap.add_argument("--E", type=benchlib.positive_int_list, default=[64, 256, 1024], help="experts, a list")
    ap.add_argument("--T", type=benchlib.positive_int_list, default=[16, 128, 512, 1024, 2048, 4096],
                    help="tokens, a list")
    ap.add_argument("--K", type=benchlib.positive_int, default=8, help="experts a token")
    ap.add_argument("--map", action="store_true", help="route by a bool routing map [T, E] instead of top-k ids")
    ap.add_argument("--side", choices=("one", "three"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.E, a.T = [64], [16, 128]
    if a.side:
        print(json.dumps(_side(a.E, a.T, a.K, a.iters, a.warmup, a.map)))
        return 0
    benchlib.require_gpu("tools/bench_plan.py")
    argv = ["--E", ",".join(map(str, a.E)), "--T", ",".join(map(str, a.T)), "--K", str(a.K), "--iters",
            str(a.iters), "--warmup", str(a.warmup)] + (["--map"] if a.map else [])
    knob = "MOE_RT_PLAN_FUSED_MAP_SLOTS" if a.map else "MOE_RT_PLAN_FUSED_SLOTS"
    got = benchlib.run_sides(os.path.abspath(__file__), argv, [("three", {knob: "0"}), ("one", {knob: str(_ALL)})])
    sides = {side: {(E, T): (us, host) for E, T, us, host in rows} for side, rows in got.items()}
    table = benchlib.Table("make_plan: one CTA against three kernels" + (", bool routing map" if a.map else ""),
                           ["E", "T", "K", "slots", "one CTA us", "three kernels us", "x", "picked",
                            "host us one CTA", "host us three kernels"])
    table.header()
    for E in a.E:
        for T in a.T:
            (one, h1), (three, h3) = sides["one"][(E, T)], sides["three"][(E, T)]
            # what the planner picks with the default limits (this process leaves the knobs as found)
            first = _xla.planned_kernels("make_plan", (9, 0), routing_dtype=5 if a.map else 3, T=T,
                                         K=E if a.map else a.K, E=E, align_size=1,
                                         num_out_tokens=T * a.K if a.map else -1)[0][1]
            picked = "one CTA" if first.startswith("plan_fused") else "three kernels"
            table.add(E=E, T=T, K=a.K, slots=T * (E if a.map else a.K),
                      **{"one CTA us": one, "three kernels us": three, "x": three / one, "picked": picked,
                         "host us one CTA": h1, "host us three kernels": h3})
    table.finish(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
