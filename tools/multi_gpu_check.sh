#!/usr/bin/env bash
# Every multi-GPU test (EP at 2 and 4 ranks, both transports; the EP adapters; the bench command's EP run)
# and the JAX EP demo, in one call on a machine with 2+ GPUs.
#   tools/multi_gpu_check.sh OUTDIR
set -u
OUT=${1:?usage: tools/multi_gpu_check.sh OUTDIR}
source "$(dirname "$0")/gpu_lib.sh"
export MOE_RT_KERNEL_CACHE=${MOE_RT_KERNEL_CACHE:-/tmp/moe_rt_kc}
step warmup 90 python3 -m moe_rt warmup --quiet
step multi_gpu 420 python3 -m pytest -q -rA -m multi_gpu tests
grep -E "passed|failed|PASSED|FAILED|SKIPPED" "$OUT/multi_gpu.log" | head -40
step demo_jax2 120 python3 -m moe_rt demo --framework jax --ep 2 --steps 5
grep -E "rank 0\]|FAIL|Error" "$OUT/demo_jax2.log" | head -14
