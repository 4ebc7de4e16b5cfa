#!/usr/bin/env bash
# One H200 (device tool, kind nvidia-h200): session 9's final checks on the bf16 V2-Lite real-shape synthetic.
# GPU_TESTS while it is made and compiled; `mlac prepare`; then the end-to-end yardstick (serve_gpu.py, a fresh
# `mlac serve --require-prepared` from an empty ~/.triton: start-up phases, batches 1/32/256, peak of 1,024 requests).
# $OUT: gpu_tests.txt, serve_final.json, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
prepared_bf16  # gpu_env.sh: build, GPU_TESTS meanwhile, prepare
rm -rf ~/.triton; unset TRITON_CACHE_DIR
timeout -k 10 ${SERVE_S:-170} python3 benchmarks/serve_gpu.py $W/bf16 --device cuda --json "$OUT/serve_final.json" \
  --log $W/serve.log --batches 1,32,256 --prompt-len 64 --max-tokens 64 --peak-requests 1024 \
  --peak-prompt-len 128 --peak-max-tokens 128 --max-running-requests 256 --max-queue 1024 \
  --serve-args "--no-verify --require-prepared --kv-cache-bytes 17179869184" --budget-s $(( ${SERVE_S:-170} - 10 )) | tail -2
stamp "serve rc=$?"; grep -i "error\|Traceback\|Triton compiled" $W/serve.log | tail -3
python3 - "$OUT/serve_final.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("startup", d.get("startup"))
for k, v in (d.get("decode") or {}).items():
    print(k, {x: v.get(x) for x in ("output_tokens_per_s", "ttft_ms_p50", "server_triton_jit_compiles", "server_num_preemptions")})
print("peak", {x: (d.get("peak") or {}).get(x) for x in ("output_tokens_per_s", "server_triton_jit_compiles")})
PY
