#!/usr/bin/env bash
# One GPU in two calls on the same warm machine (each under the 10-minute limit):
#   tools/gpu_round.sh OUTDIR compile   install, tools/bench_compile.py (each case on its own empty cache,
#                                       the demo, warmup), then warmup into /tmp/moe_rt_kc
#   tools/gpu_round.sh OUTDIR tests [PYTEST ARGS]   the GPU tests on that cache (default: every gpu test),
#                                       then the router benchmark at T=65536
set -u
OUT=${1:?usage: tools/gpu_round.sh OUTDIR compile|tests [pytest args]}
WHAT=${2:?usage: tools/gpu_round.sh OUTDIR compile|tests [pytest args]}
shift 2
source "$(dirname "$0")/gpu_lib.sh"
export MOE_RT_KERNEL_CACHE=/tmp/moe_rt_kc
if [ "$WHAT" = compile ]; then
  step bench_compile 420 env -u MOE_RT_KERNEL_CACHE python3 tools/bench_compile.py --json "$OUT/bench_compile.json"
  tail -16 "$OUT/bench_compile.log"
  step warmup 120 python3 -m moe_rt warmup --quiet
  tail -2 "$OUT/warmup.log"
else
  if [ $# -eq 0 ]; then set -- -m gpu tests; fi
  [ -f /tmp/moe_rt_kc/manifest.json ] || step warmup 120 python3 -m moe_rt warmup --quiet
  step gpu_tests 400 python3 -m pytest -q -rf "$@"
  grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.log" | head -40; tail -3 "$OUT/gpu_tests.log"
  if [ -n "${ROUTER_BENCH:-}" ]; then
    step bench_router 150 python3 tools/bench_router.py --quick --no-compile --json "$OUT/bench_router.json"
    grep -E "^\|" "$OUT/bench_router.log" | head -30
  fi
  if [ -n "${COMPILE_BENCH:-}" ]; then
    step bench_compile 200 env -u MOE_RT_KERNEL_CACHE python3 tools/bench_compile.py --no-demo --no-warmup --json "$OUT/bench_compile.json"
    grep -E "^first" "$OUT/bench_compile.log" | cut -c1-400
  fi
fi
