#!/usr/bin/env bash
# One H200 (device tool, kind nvidia-h200), session 8's checks of issue #15 on the V2-Lite real-shape synthetic,
# bf16, prepared: GPU_TESTS (if set) while the checkpoint is made and compiled; `mlac prepare`; one fresh
# `mlac serve --require-prepared` start (serve_gpu.py, phases incl. the graphs' eager runs and captures);
# prefix_workload.py (one token per request at concurrency 1-64, then 32 tokens at ${OUT32_LEVELS:-16});
# profile_prefill.py with cached batches (${BATCHES:-4,16,32} suffixes over one cached prefix in one step;
# not with SKIP_PROFILE=1).
# EXTEND_SWEEP=1 first runs bench_extend_absorbed.py (extend_absorbed.json).
# $OUT: gpu_tests.txt, serve_startup.json, prefix_workload{,_out32}.json, profile_prefill.json, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
git log --oneline -1 2>/dev/null
( python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 \
  && python3 -m mlac.cli compile $C $W/bf16 --skip-accuracy-check >$W/c1.log 2>&1 ) &
BUILD=$!
if [ -n "${EXTEND_SWEEP:-}" ]; then  # the absorbed extend's launch configs at a cached burst's shapes
  timeout 300 python3 benchmarks/bench_extend_absorbed.py --json "$OUT/extend_absorbed.json" | tail -n 4
  stamp "extend sweep rc=$?"
fi
if [ -n "${GPU_TESTS:-}" ]; then
  timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS >"$OUT/gpu_tests.txt" 2>&1
  stamp "gpu tests rc=$?"; tail -n 4 "$OUT/gpu_tests.txt"
fi
wait $BUILD; stamp "synth + compile rc=$?"; tail -n 1 $W/c1.log; rm -rf $C
timeout 170 python3 -m mlac.cli prepare $W/bf16 --device cuda --max-running-requests 256 2>&1 | tail -1; stamp prepare
rm -rf ~/.triton; unset TRITON_CACHE_DIR
timeout -k 10 90 python3 benchmarks/serve_gpu.py $W/bf16 --device cuda --json "$OUT/serve_startup.json" \
  --log $W/serve.log --batches 1 --prompt-len 16 --max-tokens 4 --peak-requests 0 --max-running-requests 256 \
  --serve-args=--require-prepared --budget-s 60 | tail -1
python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('startup'))" "$OUT/serve_startup.json"
stamp "serve start"
WL=(python3 benchmarks/prefix_workload.py $W/bf16 --device cuda
    --serve-args "--no-verify --require-prepared --kv-cache-bytes 17179869184")
timeout -k 10 240 "${WL[@]}" --json $W/prefix_workload.json | grep -v "^+"; stamp "workload rc=$?"
timeout -k 10 150 "${WL[@]}" --max-tokens 32 --concurrency ${OUT32_LEVELS:-16} --json $W/prefix_workload_out32.json \
  | grep -v "^+"; stamp "workload out32 rc=$?"
cp $W/prefix_workload.json $W/prefix_workload_out32.json "$OUT/"
if [ -z "${SKIP_PROFILE:-}" ]; then
  timeout -k 10 200 python3 benchmarks/profile_prefill.py $W/bf16 --json "$OUT/profile_prefill.json" \
    --batches ${BATCHES:-4,16,32} | grep -E "^(cold|cached)"; stamp "profile prefill rc=$?"
fi
