#!/usr/bin/env bash
# The direct EP transport on a multi-GPU machine in one call: warmup, its multi-GPU tests (2 and 4 ranks:
# against the reference, bitwise against NCCL, graph replay, dead peer), and the EP benchmark at 4 and 2 ranks.
#   tools/ep_iter.sh OUTDIR [TOKENS]      (TOKENS: bench_ep's --tokens, default 4096,16384)
set -u
OUT=${1:?usage: tools/ep_iter.sh OUTDIR [TOKENS]}
TOK=${2:-4096,16384}
source "$(dirname "$0")/gpu_lib.sh"
if [ -n "${DEMO_EP:-}" ]; then  # first use: the torch EP demo on an empty kernel cache, timed
  step demo_ep4 150 env MOE_RT_KERNEL_CACHE=/tmp/moe_rt_empty_ep python3 -m moe_rt demo --framework torch --ep 4 --tokens 2048
  grep -E "rank 0\]|FAIL|Error|ok" "$OUT/demo_ep4.log" | head -8
fi
export MOE_RT_KERNEL_CACHE=/tmp/moe_rt_kc
step warmup 150 python3 -m moe_rt warmup --quiet
step ep_direct 420 python3 -m pytest -q -x -rA tests/test_ep.py -k "transports or direct_dead"
grep -E "passed|failed|PASSED|FAILED|Error|error|mismatch" "$OUT/ep_direct.log" | head -30
if [ -n "${EXTRA_TESTS:-}" ]; then  # single-GPU tests on GPU 0 of the same machine
  step extra_tests 300 python3 -m pytest -q -rf -m gpu $EXTRA_TESTS
  grep -E "^FAILED|^ERROR" "$OUT/extra_tests.log" | head -30; tail -2 "$OUT/extra_tests.log"
fi
for n in 4 2; do
  step bench_ep$n 240 env MOE_RT_BENCH_EP_NPROC=$n python3 tools/bench_ep.py --tokens "$TOK" --chunks 2 --json "$OUT/bench_ep$n.json"
  grep -E "Error|Traceback" "$OUT/bench_ep$n.log" | head -5; tail -24 "$OUT/bench_ep$n.log"
done
