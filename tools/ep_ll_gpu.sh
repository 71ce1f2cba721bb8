#!/usr/bin/env bash
# The low-latency EP mode (moe_rt/ep_ll.py) on a 4-GPU machine in one call: its kernels compiled, the one-GPU
# tests, the multi-GPU tests (2 and 4 ranks: reference, graph replay, dead peer), then bench_ep
# --mode low_latency at 4 and 2 ranks (T=128 per rank by default).
#   tools/ep_ll_gpu.sh OUTDIR [TOKENS]      (TOKENS: bench_ep's --tokens, default 128)
set -u
OUT=${1:?usage: tools/ep_ll_gpu.sh OUTDIR [TOKENS]}
TOK=${2:-128}
source "$(dirname "$0")/gpu_lib.sh"
export MOE_RT_KERNEL_CACHE=/tmp/moe_rt_kc
step ll_one_gpu 300 python3 -m pytest -q -x -rA tests/test_ep_ll.py -m gpu
grep -E "passed|failed|FAILED|Error|error" "$OUT/ll_one_gpu.log" | head -20
step ll_multi_gpu 420 python3 -m pytest -q -rA tests/test_ep_ll.py -m multi_gpu
grep -E "passed|failed|PASSED|FAILED|Error|error|rank 0\]" "$OUT/ll_multi_gpu.log" | head -40
for n in 4 2; do
  step bench_ll$n 200 env MOE_RT_BENCH_EP_NPROC=$n python3 tools/bench_ep.py --mode low_latency --tokens "$TOK" \
    --json "$OUT/bench_ll$n.json"
  grep -E "Error|Traceback" "$OUT/bench_ll$n.log" | head -5; tail -14 "$OUT/bench_ll$n.log"
done
