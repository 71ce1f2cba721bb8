#!/usr/bin/env bash
# Expert parallelism on a 4-GPU machine in one call: the torch EP demo on an empty kernel cache (timed), a
# warmup, the multi-GPU EP tests (2 and 4 ranks, both transports), and the EP benchmark at 4 and 2 ranks.
#   tools/ep_quick.sh OUTDIR [TOKENS]      (TOKENS: bench_ep's --tokens, default 4096,16384)
set -u
OUT=${1:?usage: tools/ep_quick.sh OUTDIR [TOKENS]}
TOK=${2:-4096,16384}
source "$(dirname "$0")/gpu_lib.sh"
step demo_ep4 150 env MOE_RT_KERNEL_CACHE=/tmp/moe_rt_empty_ep python3 -m moe_rt demo --framework torch --ep 4 --tokens 2048
grep -E "rank 0\]|FAIL|Error|ok" "$OUT/demo_ep4.log" | head -12
export MOE_RT_KERNEL_CACHE=/tmp/moe_rt_kc
step warmup 90 python3 -m moe_rt warmup --quiet
step ep_tests 300 python3 -m pytest -q -x -rA tests/test_ep.py -k multi_gpu
grep -E "passed|failed|PASSED|FAILED|Error|error" "$OUT/ep_tests.log" | head -30
for n in 4 2; do
  step bench_ep$n 200 env MOE_RT_BENCH_EP_NPROC=$n python3 tools/bench_ep.py --tokens "$TOK" --json "$OUT/bench_ep$n.json"
  grep -E "Error|Traceback" "$OUT/bench_ep$n.log" | head -5; tail -30 "$OUT/bench_ep$n.log"
done
