#!/usr/bin/env bash
# First use on a fresh GPU machine, in one call: install, tools/bench_compile.py (every case on its own empty
# kernel cache), then the GPU test suite on an empty cache, then (optionally) the router benchmark on the
# cache the tests filled.
#   tools/first_use_gpu.sh OUTDIR [--ep N] [--router]
set -u
OUT=${1:?usage: tools/first_use_gpu.sh OUTDIR [--ep N] [--router]}
shift
EP=0; ROUTER=0
while [ $# -gt 0 ]; do
  case $1 in --ep) EP=$2; shift 2;; --router) ROUTER=1; shift;; *) echo "unknown argument $1"; exit 2;; esac
done
source "$(dirname "$0")/gpu_lib.sh"
step bench_compile 200 python3 tools/bench_compile.py --ep "$EP" --json "$OUT/bench_compile.json"
cat "$OUT/bench_compile.log" | tail -15
export MOE_RT_KERNEL_CACHE=/tmp/moe_rt_empty_cache_$$
step gpu_tests 360 python3 -m pytest -q -x -rs -m "gpu" tests
tail -8 "$OUT/gpu_tests.log"
if [ "$ROUTER" = 1 ]; then
  step bench_router 300 python3 tools/bench_router.py --no-compile --json "$OUT/bench_router.json"
  tail -25 "$OUT/bench_router.log"
fi
