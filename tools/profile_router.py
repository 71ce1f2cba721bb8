"""Run one router kernel launch per case between cudaProfilerStart/Stop, for Nsight Compute.

Each case compiles and warms up its kernels first, so the profiled launch is the steady-state kernel.
Use with ``ncu --profile-from-start off`` (and ``MOE_RT_NVRTC_OPTIONS=-lineinfo`` for the source view):

    ncu --profile-from-start off --set full --import-source yes -o OUT python3 tools/profile_router.py CASE...

Cases: ``{fwd,bwd,bwdbits}-{softmax,grouped,sigbias}-{f32,bf16}-E{256,2304}`` (softmax: post-softmax top-k;
grouped: sigmoid, 8 groups, top-4 groups, expert bias; sigbias: sigmoid and expert bias, no groups; K = 8 at E = 256, 36 at E = 2304; bwdbits: the backward from the
bit-packed map, ``routing_map_format="bitmap_u8"``), and ``qb-{fused,twokernel}-{f32,bf16}-E{256,2304}``
(topk_with_score_qb: sigmoid + expert bias, B = 64 bins, ``qb_histogram_mode`` "fused_atomic" or "two_kernel"),
T = ``--tokens`` (default 65536). ``--list`` prints the cases.
"""
from __future__ import annotations

import argparse
import itertools

import numpy as np

CASES = [f"{op}-{sf}-{dt}-E{E}" for op, sf, dt, E in
         itertools.product(("fwd", "bwd", "bwdbits"), ("softmax", "grouped", "sigbias"), ("f32", "bf16"), (256, 2304))]
CASES += [f"qb-{mode}-{dt}-E{E}" for mode, dt, E in
          itertools.product(("fused", "twokernel"), ("f32", "bf16"), (256, 2304))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    if a.list:
        print("\n".join(CASES))
        return
    bad = [c for c in a.cases if c not in CASES]
    if bad:
        raise SystemExit(f"unknown case(s) {bad}; --list prints the cases")
    import cupy as cp

    import moe_rt.router as R
    from moe_rt import _arrays

    for case in a.cases:
        op, sf, dt, e = case.split("-")
        E = int(e[1:])
        K = 8 if E == 256 else 36
        dtype = np.float32 if dt == "f32" else _arrays.BFLOAT16
        rng = cp.random.default_rng(1)
        x = rng.standard_normal((a.tokens, E), dtype=np.float32).astype(dtype)
        kw = {}
        if op == "qb":
            bias = cp.asarray((np.random.default_rng(2).permutation(E) * (0.1 / E)).astype(np.float32))
            hist = cp.zeros((E, 64), dtype=cp.int32)
            bounds = cp.asarray(np.array([-1.0, 1.0], dtype=np.float32))
            mode = "fused_atomic" if sf == "fused" else "two_kernel"

            def run():
                return R.topk_with_score_qb(x, K, expert_bias=bias, qb_histogram=hist, qb_bin_bounds=bounds,
                                            qb_histogram_mode=mode, bounds_validated=True)
            _profile(cp, case, run)
            continue
        if sf == "grouped":
            bias = cp.asarray((np.random.default_rng(2).permutation(E) * (0.1 / E)).astype(np.float32))
            kw = dict(score_function="sigmoid", num_groups=8, group_topk=4, expert_bias=bias)
        elif sf == "sigbias":  # the plain forward the QB forward adds its cutoff and histogram to
            bias = cp.asarray((np.random.default_rng(2).permutation(E) * (0.1 / E)).astype(np.float32))
            kw = dict(score_function="sigmoid", expert_bias=bias)
        fn_name = "softmax" if sf == "softmax" else "sigmoid"
        if op == "fwd":
            def run():
                return R.topk_with_score(x, K, **kw)
        else:
            fmt = "bitmap_u8" if op == "bwdbits" else "bytemap"
            _, rmap, inter = R.topk_with_score(x, K, routing_map_format=fmt, **kw)
            g = rng.standard_normal((a.tokens, E), dtype=np.float32).astype(dtype)

            def run():
                return R.topk_with_score_backward(g, rmap, inter, K, score_function=fn_name, routing_map_format=fmt)
        _profile(cp, case, run)


def _profile(cp, case, run):
    """Warm up (compile) ``run``, then one launch between cudaProfilerStart/Stop."""
    for _ in range(3):
        run()
    cp.cuda.Device().synchronize()
    cp.cuda.runtime.profilerStart()
    run()
    cp.cuda.Device().synchronize()
    cp.cuda.runtime.profilerStop()
    print(f"{case}: profiled", flush=True)


if __name__ == "__main__":
    main()
