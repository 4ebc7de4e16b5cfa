#!/usr/bin/env bash
# Start in seconds, on one H200 (device tool, kind nvidia-h200): the real-shape V2-Lite synthetic
# compiled bf16, prepared here (`mlac prepare`: every Triton kernel of the buckets and the warm-up
# shapes into cache/<target>/), then served by benchmarks/serve_gpu.py from a fresh process with an
# empty ~/.triton and TRITON_CACHE_DIR unset, hashes verified, `--require-prepared`. The server's
# /metrics counts Triton JIT compiles (mlac_triton_jit_compiles_total). Then the tiny zero-JIT test.
# $OUT: serve_prepared.json, prepare.txt, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 || { tail -5 $W/synth.log; exit 1; }; stamp synth
python3 -m mlac.cli compile $C $W/bf16 --skip-accuracy-check >$W/c1.log 2>&1 || { tail -5 $W/c1.log; exit 1; }
stamp compile; rm -rf $C
timeout 170 python3 -m mlac.cli prepare $W/bf16 --device cuda --max-running-requests 256 2>&1 | tail -5 | tee "$OUT/prepare.txt"; stamp "prepare"
python3 -m mlac.cli inspect $W/bf16 | grep -i "cache\|identity"
rm -rf ~/.triton; unset TRITON_CACHE_DIR
timeout -k 10 ${SERVE_S:-150} python3 benchmarks/serve_gpu.py $W/bf16 --device cuda --json "$OUT/serve_prepared.json" \
  --log $W/serve.log --batches 1,32,256 --prompt-len 64 --max-tokens 64 --peak-requests ${PEAK:-512} \
  --peak-prompt-len 128 --peak-max-tokens 128 --max-running-requests 256 --max-queue 1024 \
  --serve-args=--require-prepared --budget-s $(( ${SERVE_S:-150} - 10 ))
stamp "serve rc=$?"; grep -i "ready in\|kernel cache\|error" $W/serve.log | head -5
ls ~/.triton/cache 2>/dev/null | wc -l | sed 's/^/files in ~\/.triton\/cache after serving: /'
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/tools/test_prepare.py -m gpu 2>&1 | tail -4; stamp "zero-JIT test"
