# Sourced (`. benchmarks/gpu_env.sh`) by the benchmarks/run_*.sh scripts of the device tool, in the
# repository root: the log (stdout and stderr into $OUT/log.txt too), the carried wheels (.whl/, when
# there) into /tmp/site, the environment, the work folders W and C, the GPUs, and `stamp MSG`.
exec > >(tee -a "$OUT/log.txt") 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast (KINDS.md)
W=${W:-/tmp/w}; C=${C:-/dev/shm/ckpt}; mkdir -p "$W"  # C: a 31 GB checkpoint in memory (the disk holds 64 GB)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# prepared_bf16: the bf16 V2-Lite real-shape synthetic into $W/bf16 (synthesized and compiled in the background
# while GPU_TESTS, if set, run into $OUT/gpu_tests.txt), then `mlac prepare` for up to 256 running requests.
prepared_bf16() {
  ( python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 \
    && python3 -m mlac.cli compile $C $W/bf16 --skip-accuracy-check >$W/c1.log 2>&1 ) &
  local build=$!
  if [ -n "${GPU_TESTS:-}" ]; then
    timeout ${GPU_TESTS_S:-280} python3 -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS >"$OUT/gpu_tests.txt" 2>&1
    stamp "gpu tests rc=$?"; tail -n 4 "$OUT/gpu_tests.txt"
  fi
  wait $build; stamp "synth + compile rc=$?"; tail -n 1 $W/c1.log; rm -rf $C
  timeout 170 python3 -m mlac.cli prepare $W/bf16 --device cuda --max-running-requests 256 2>&1 | tail -1; stamp prepare
}
