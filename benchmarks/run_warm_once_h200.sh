#!/usr/bin/env bash
# One H200 (device tool, kind nvidia-h200): the CUDA graphs' warm-once capture (graphs.capture_buckets).
# GPU_TESTS (if set) while the bf16 V2-Lite real-shape synthetic is made and compiled; `mlac prepare`; then
# fresh `mlac serve --require-prepared` starts from an empty ~/.triton, alternating MLAC_GRAPH_WARM_ONCE=0
# (every bucket runs eagerly before its capture) and the default, ROUNDS (2) rounds; the default's first
# start also serves batches 1 and 32 (JIT compiles after start-up: 0 expected).
# $OUT: gpu_tests.txt, serve_startup_{each,once}_<round>.json, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
prepared_bf16  # gpu_env.sh: build, GPU_TESTS meanwhile, prepare
for r in $(seq 1 ${ROUNDS:-2}); do
  for mode in each once; do
    rm -rf ~/.triton; unset TRITON_CACHE_DIR
    warm=1; [ $mode = each ] && warm=0
    serve=(--batches 1 --prompt-len 16 --max-tokens 4)
    [ $mode = once ] && [ $r = 1 ] && serve=(--batches 1,32 --prompt-len 64 --max-tokens 32)
    MLAC_GRAPH_WARM_ONCE=$warm timeout -k 10 120 python3 benchmarks/serve_gpu.py $W/bf16 --device cuda \
      --json "$OUT/serve_startup_${mode}_$r.json" --log $W/serve_$mode$r.log "${serve[@]}" --peak-requests 0 \
      --max-running-requests 256 --serve-args=--require-prepared --budget-s 60 | tail -1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('startup'),
      {k: v.get('server_triton_jit_compiles') for k, v in (d.get('decode') or {}).items()})" \
      "$OUT/serve_startup_${mode}_$r.json"
    stamp "serve $mode round $r"
  done
done
