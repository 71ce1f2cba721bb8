#!/usr/bin/env bash
# Multi-GPU checks of expert parallelism in one go (2+ GPUs): the EP tests, the EP adapter tests (one GPU
# and the `demo --ep 2` layer in torch and JAX), the EP benchmark, and the demo at its default size.
#   tools/ep_gpu_run.sh OUTDIR
set -u
OUT=${1:?usage: tools/ep_gpu_run.sh OUTDIR}
source "$(dirname "$0")/gpu_lib.sh"
export MOE_RT_KERNEL_CACHE=${MOE_RT_KERNEL_CACHE:-/tmp/moe_rt_kernel_cache}
step ep_tests 600 python3 -m pytest -q -x -rA tests/test_ep.py -k multi_gpu
grep -E "passed|failed|cases OK|replays OK|iterations flat|DEAD PEER OK|transports:|Error" "$OUT/ep_tests.log" | head -30
step adapters 300 python3 -m pytest -q -rA tests/test_ep_adapters.py -m "gpu or multi_gpu"
grep -E "passed|failed|FAIL|Error|\[rank .\]  " "$OUT/adapters.log" | head -40
if [ "${MOE_RT_SKIP_BENCH:-0}" != 1 ]; then
  step bench_ep 240 python3 tools/bench_ep.py --parts --json "$OUT/bench_ep.json"
  grep -E "Error|Traceback" "$OUT/bench_ep.log" | head -5; tail -42 "$OUT/bench_ep.log"
fi
for fw in torch jax; do
  step demo_$fw 120 python3 -m moe_rt demo --framework $fw --ep 2 --steps 10
  grep -E "rank 0\]|FAIL|Error" "$OUT/demo_$fw.log" | head -14
done
