#!/usr/bin/env bash
# One H200 (device tool, kind nvidia-h200): the shared-prefix (cascade) extend attention on the V2-Lite
# real-shape synthetic, bf16, prepared. GPU_TESTS (if set) while it is made and compiled; `mlac prepare`; then,
# with the cascade (the default) and without (MLAC_SHARED_PREFIX=0): profile_prefill.py with ${BATCHES:-4,16,32}
# cached suffixes in one step, and prefix_workload.py at concurrency ${LEVELS:-1,4,16,64}.
# $OUT: gpu_tests.txt, profile_prefill_{on,off}.json, prefix_workload_{on,off}.json, log.txt (with any JIT compile
# the servers logged while serving).
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
prepared_bf16  # gpu_env.sh: build, GPU_TESTS meanwhile, prepare
for mode in on off; do
  sp=1; [ $mode = off ] && sp=0
  MLAC_SHARED_PREFIX=$sp timeout -k 10 150 python3 benchmarks/profile_prefill.py $W/bf16 \
    --json "$OUT/profile_prefill_$mode.json" --batches ${BATCHES:-4,16,32} | grep -E "^(cold|cached)"
  stamp "profile prefill $mode rc=$?"
done
for mode in on off; do
  sp=1; [ $mode = off ] && sp=0
  MLAC_SHARED_PREFIX=$sp timeout -k 10 150 python3 benchmarks/prefix_workload.py $W/bf16 --device cuda \
    --serve-args "--no-verify --require-prepared --kv-cache-bytes 17179869184" --concurrency ${LEVELS:-1,4,16,64} \
    --json "$W/prefix_workload_$mode.json" | grep -v "^+" | tail -n 30
  stamp "workload $mode rc=$?"; cp $W/prefix_workload_$mode.json "$OUT/"
  grep -h "Triton compiled" $W/prefix_workload_${mode}_*.log | head -n 5
done
