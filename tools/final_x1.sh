#!/usr/bin/env bash
# One GPU, one call: the router benchmark with the other routing outputs and QB (T=65536, its kernels compiled
# on demand), then the whole GPU test suite on an empty kernel cache (bounded by STEP_S seconds).
#   tools/final_x1.sh OUTDIR [STEP_S]
set -u
OUT=${1:?usage: tools/final_x1.sh OUTDIR [STEP_S]}
STEP_S=${2:-380}
source "$(dirname "$0")/gpu_lib.sh"
export MOE_RT_KERNEL_CACHE=/tmp/moe_rt_kc_bench
step bench_router 200 python3 tools/bench_router.py --T 65536 --iters 20 --no-compile --formats --ops all --json "$OUT/bench_router.json"
grep -E "^\|" "$OUT/bench_router.log" | head -40
export MOE_RT_KERNEL_CACHE=/tmp/moe_rt_kc_empty
step gpu_suite_empty_cache "$STEP_S" python3 -m pytest -q -rf -m gpu tests
grep -E "^FAILED|^ERROR" "$OUT/gpu_suite_empty_cache.log" | head -30; tail -2 "$OUT/gpu_suite_empty_cache.log"
