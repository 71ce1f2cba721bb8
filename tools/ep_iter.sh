#!/usr/bin/env bash
# Expert parallelism on a multi-GPU machine in one call: warmup, the multi-GPU tests (direct and NCCL transports
# against the reference and each other, graph replay, lifecycle, dead peer; with LL=1 the low-latency mode's
# too), and the EP benchmark at each rank count in RANKS.
#   tools/ep_iter.sh OUTDIR [TOKENS]      (TOKENS: bench_ep's --tokens, default 4096,16384)
# Environment: RANKS (default "4 2"; "2" on a 2-GPU machine), LL=1 (low-latency tests and bench at T=128; LL_K: a
# pytest -k expression for those tests),
# TESTS (pytest -k expression for tests/test_ep.py's multi-GPU tests, default every one; none: skip them; "mixed":
# the mixed group's), TESTS_TIMEOUT (seconds for them, default 420),
# EXTRA_TESTS (more pytest arguments, run with -m "gpu or multi_gpu" after), FP8=1 (bench_ep --fp8: FP8 dispatch
# rows beside bf16; with LL=1 also the low-latency FP8 dispatch rows), DEMO_EP=1 (the torch EP demo on an empty
# kernel cache first, timed), CHUNKS (bench_ep's --chunks, default 2; e.g. 2,m1,m2: the mixed groups of nodes of
# 1 and 2 ranks beside it; an m<n> that does not divide a rank count in RANKS is dropped for that count).
set -u
OUT=${1:?usage: tools/ep_iter.sh OUTDIR [TOKENS]}
TOK=${2:-4096,16384}
RANKS=${RANKS:-4 2}
source "$(dirname "$0")/gpu_lib.sh"
NMAX=$(echo $RANKS | tr ' ' '\n' | sort -n | tail -1)
if [ -n "${DEMO_EP:-}" ]; then
  step demo_ep 150 env MOE_RT_KERNEL_CACHE=/tmp/moe_rt_empty_ep python3 -m moe_rt demo --framework torch --ep "$NMAX" --tokens 2048
  grep -E "rank 0\]|FAIL|Error|ok" "$OUT/demo_ep.log" | head -8
fi
export MOE_RT_KERNEL_CACHE=/tmp/moe_rt_kc
step warmup 150 python3 -m moe_rt warmup --quiet
if [ "${TESTS:-}" != none ]; then
  step ep_multi ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rA -m multi_gpu tests/test_ep.py ${TESTS:+-k "$TESTS"}
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|mismatch" "$OUT/ep_multi.log" | head -30
fi
if [ -n "${LL:-}" ]; then
  step ll_tests 540 python3 -m pytest -q -rA tests/test_ep_ll.py -m "gpu or multi_gpu" ${LL_K:+-k "$LL_K"}
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/ll_tests.log" | head -30
fi
if [ -n "${EXTRA_TESTS:-}" ]; then
  step extra_tests 300 python3 -m pytest -q -rf -m "gpu or multi_gpu" $EXTRA_TESTS
  grep -E "^FAILED|^ERROR" "$OUT/extra_tests.log" | head -30; tail -2 "$OUT/extra_tests.log"
fi
for n in $RANKS; do
  CH=$(echo "${CHUNKS:-2}" | tr ',' '\n' | awk -v n=$n '!/^m/ || (n % substr($0, 2) == 0)' | paste -sd, -)
  step bench_ep$n 240 env MOE_RT_BENCH_EP_NPROC=$n python3 tools/bench_ep.py --tokens "$TOK" --chunks "$CH" ${FP8:+--fp8} --json "$OUT/bench_ep$n.json"
  grep -E "Error|Traceback" "$OUT/bench_ep$n.log" | head -5; tail -24 "$OUT/bench_ep$n.log"
  if [ -n "${LL:-}" ]; then
    step bench_ll$n 200 env MOE_RT_BENCH_EP_NPROC=$n python3 tools/bench_ep.py --mode low_latency --tokens 128 \
      ${FP8:+--fp8} --json "$OUT/bench_ll$n.json"
    grep -E "Error|Traceback" "$OUT/bench_ll$n.log" | head -5; tail -16 "$OUT/bench_ll$n.log"
  fi
done
