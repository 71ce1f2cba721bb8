# Sourced by the tools/*.sh GPU scripts after they set OUT: the environment every GPU run keeps (NVLink
# multicast off everywhere), the in-place install (no network on the GPU machines), and `step`.
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi -L
# The benchmarks record the commit they measured: pass MOE_RT_COMMIT=<hash> with the command (a copied tree's
# git, if any, may not be the one measured).
[ -n "${MOE_RT_COMMIT:-}" ] || echo "MOE_RT_COMMIT is not set: the tables' commit comes from this machine's git"

step() {  # step NAME TIMEOUT CMD...: run, log to OUT/NAME.log, print the status and the seconds it took
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 )) s"
  return $rc
}
