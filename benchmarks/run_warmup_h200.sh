#!/usr/bin/env bash
# The server's warm-up (`mlac serve --warmup`, the default) measured on one H200 (device tool, kind
# nvidia-h200): a V3-shaped 2-layer synthetic compiled --fp8 at tp1, served three times by
# benchmarks/serve_gpu.py, each with its own Triton cache directory:
#   nowarmup-cold  --no-warmup, empty cache  (the first requests compile)
#   warmup-cold    --warmup,    empty cache  (the compiles move before /health turns 200)
#   warmup-cached  --warmup,    the cache the run before filled (a restart on the same machine)
# $OUT: serve_warmup_<run>.json, steps.txt, log.txt.
set -uo pipefail
exec > >(tee -a "$OUT/log.txt") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=16
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=/tmp/w; mkdir -p $W
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/steps.txt"
t=$(date +%s)
python3 -m mlac.cli synth --from-config tests/configs/DeepSeek-V3.json --num-layers 2 $W/ckpt >$W/synth.log 2>&1 || { tail -5 $W/synth.log; exit 1; }
echo "synth $(( $(date +%s) - t )) s" | tee -a "$OUT/steps.txt"; t=$(date +%s)
python3 -m mlac.cli compile $W/ckpt $W/tp1 --fp8 --skip-accuracy-check >$W/compile.log 2>&1 || { tail -5 $W/compile.log; exit 1; }
echo "compile $(( $(date +%s) - t )) s" | tee -a "$OUT/steps.txt"
rm -rf $W/ckpt
SIZES="--batches 1,32,256 --prompt-len 64 --max-tokens 64 --peak-requests 512 --peak-prompt-len 128 --peak-max-tokens 128"
run() { # run NAME CACHE_DIR SERVE_ARGS
  local t=$(date +%s)
  # shellcheck disable=SC2086
  TRITON_CACHE_DIR=$2 timeout -k 20 ${RUN_S:-140} python3 benchmarks/serve_gpu.py $W/tp1 --json "$OUT/serve_warmup_$1.json" \
    --log $W/serve-$1.log --serve-args="$3" $SIZES --max-running-requests 256 --startup-timeout 100 \
    --phase-timeout 30 --peak-timeout 40 --budget-s 125
  echo "run $1: rc=$? $(( $(date +%s) - t )) s" | tee -a "$OUT/steps.txt"
  grep -i "warm-up\|error" $W/serve-$1.log | tail -3
}
run nowarmup-cold /tmp/tc-a "--no-warmup"
run warmup-cold /tmp/tc-b ""
run warmup-cached /tmp/tc-b ""
cat "$OUT/steps.txt"
