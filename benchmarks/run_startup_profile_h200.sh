#!/usr/bin/env bash
# One H200 (device tool, kind nvidia-h200): where a prepared bf16 V2-Lite's start-up goes. Synthesizes,
# compiles and prepares it (unless $W/bf16 is prepared already), then profile_startup.py (the imports, and the
# engine's load + graphs + warm-up under cProfile, from an empty ~/.triton), then one unprofiled `mlac serve`
# start for the phases without cProfile (serve_gpu.py, no requests).
# $OUT: imports.txt, load_profile.txt, startup.json, serve_startup.json, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
if [ ! -d $W/bf16/cache ]; then
  python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 || { tail -5 $W/synth.log; exit 1; }
  python3 -m mlac.cli compile $C $W/bf16 --skip-accuracy-check >$W/c1.log 2>&1 || { tail -5 $W/c1.log; exit 1; }
  rm -rf $C; stamp "synth + compile"
  timeout 170 python3 -m mlac.cli prepare $W/bf16 --device cuda --max-running-requests 256 2>&1 | tail -1
  stamp prepare
fi
rm -rf ~/.triton; unset TRITON_CACHE_DIR
timeout 120 python3 benchmarks/profile_startup.py $W/bf16 --device cuda --out "$OUT" --verify; stamp "profile rc=$?"
head -n 16 "$OUT/imports.txt"
rm -rf ~/.triton
timeout -k 10 90 python3 benchmarks/serve_gpu.py $W/bf16 --device cuda --json "$OUT/serve_startup.json" \
  --log $W/serve.log --batches 1 --prompt-len 16 --max-tokens 4 --peak-requests 0 --max-running-requests 256 \
  --serve-args=--require-prepared --budget-s 60 | tail -1
python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('startup'))" "$OUT/serve_startup.json"
stamp "serve rc=$?"
