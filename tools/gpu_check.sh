#!/usr/bin/env bash
# Build, test and benchmark moe_rt on a GPU machine with no network, in one go.
#
#   tools/gpu_check.sh LOGDIR [PYTEST_ARGS...]
#
# Installs the package in place (no dependencies fetched: CuPy, NCCL, torch and JAX must already be there),
# runs `pytest -m "gpu or multi_gpu"` (or the PYTEST_ARGS given), then every tools/bench_*.py, writing
# logs to LOGDIR. MOE_RT_BENCH selects benchmarks: unset = all, "none" = skip, or a comma list of names
# ("router,permutation"). MOE_RT_BENCH_ARGS is passed to every benchmark. Exit status 0 iff all passed.
set -u
LOGDIR=${1:?usage: tools/gpu_check.sh LOGDIR [PYTEST_ARGS...]}
shift
mkdir -p "$LOGDIR"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOE_RT_KERNEL_CACHE=${MOE_RT_KERNEL_CACHE:-/tmp/moe_rt_kernel_cache}
status=0

if ! python3 -m pip install --no-deps --no-build-isolation -e . >"$LOGDIR/install.log" 2>&1; then
  echo "FAILED: install (see $LOGDIR/install.log)"; tail -30 "$LOGDIR/install.log"; exit 1
fi
nvidia-smi >"$LOGDIR/nvidia-smi.txt" 2>&1
python3 -m moe_rt info >"$LOGDIR/info.txt" 2>&1 || { echo "FAILED: moe_rt info"; status=1; }
cat "$LOGDIR/info.txt"

if [ $# -eq 0 ]; then set -- -q -m "gpu or multi_gpu" tests; fi
python3 -m pytest -rs "$@" 2>&1 | tee "$LOGDIR/pytest.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "FAILED: pytest (exit $rc)"; status=1; }

sel=${MOE_RT_BENCH:-all}
if [ "$sel" != "none" ]; then
  for b in tools/bench_*.py; do
    [ -e "$b" ] || continue
    name=$(basename "$b" .py); name=${name#bench_}
    if [ "$sel" != "all" ] && [[ ",$sel," != *",$name,"* ]]; then continue; fi
    echo "== bench $name"
    # shellcheck disable=SC2086
    if ! python3 "$b" --json "$LOGDIR/bench_$name.json" ${MOE_RT_BENCH_ARGS:-} >"$LOGDIR/bench_$name.log" 2>&1; then
      echo "FAILED: bench $name"; status=1
    fi
    tail -40 "$LOGDIR/bench_$name.log"
  done
fi
[ $status -eq 0 ] && echo "gpu_check: ALL PASSED" || echo "gpu_check: FAILURES"
exit $status
