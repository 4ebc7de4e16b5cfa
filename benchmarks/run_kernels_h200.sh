#!/usr/bin/env bash
# On one H200 (device tool, kind nvidia-h200), from the repository root: every GPU-marked test
# (kernels at real shapes, the runtime on CUDA against the CPU path), then benchmarks/kernels.py.
# Results go to $OUT: gpu_tests.log, gpu_e2e.json, kernels_h200.json (+ the benchmark's stdout).
# Pydantic is carried as wheels in .whl/ (the GPU image lacks it).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpus.txt
MLAC_GPU_RESULTS=$OUT/gpu_e2e.json timeout ${GPU_TESTS_TIMEOUT:-180} \
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tee $OUT/gpu_tests.log | tail -30
timeout ${BENCH_TIMEOUT:-380} python3 benchmarks/kernels.py --out $OUT/kernels_h200.json 2>&1 | tee $OUT/kernels_h200.txt | tail -120
