#!/usr/bin/env bash
# On a 2x H200 machine (device tool, kind nvidia-h200-x2), from the repository root:
#   1. the GPU end-to-end test (runtime on CUDA through the Triton kernels vs the CPU path);
#   2. the real-shape v2-lite synthetic compiled at tp=1 and tp=2 (--fp8, then bf16), each
#      pair measured by benchmarks/multirank_gpu.py (logits vs 1 GPU, load time, decode tok/s).
# Results go to $OUT (results JSON per step, logs). Pydantic is carried as wheels in .whl/.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=16
MLAC="python3 -m mlac.cli"
W=/tmp/w; mkdir -p $W
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpus.txt
t=$(date +%s); $MLAC synth v2-lite $W/ckpt --seed 0 2>/dev/null | tail -1; echo "synth $(( $(date +%s) - t )) s" | tee -a $OUT/steps.txt
for mode in fp8 bf16; do
  flag=$([ $mode = fp8 ] && echo --fp8)
  for tp in 1 2; do
    t=$(date +%s)
    $MLAC compile $W/ckpt $W/tp$tp-$mode --tp $tp $flag --skip-accuracy-check 2>&1 | grep -v "^compiling" | tail -2
    echo "compile tp=$tp $mode $(( $(date +%s) - t )) s" | tee -a $OUT/steps.txt
  done
  python3 benchmarks/multirank_gpu.py --one $W/tp1-$mode --many $W/tp2-$mode --json $OUT/multirank_v2-lite_tp2_$mode.json 2>&1 | tail -40
  rm -rf $W/tp1-$mode $W/tp2-$mode
  if [ $mode = fp8 ]; then
    MLAC_GPU_RESULTS=$OUT/gpu_e2e.json timeout 150 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_e2e.py 2>&1 | tail -8 | tee $OUT/gpu_e2e.log
  fi
done
