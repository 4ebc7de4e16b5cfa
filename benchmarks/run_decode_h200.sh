#!/usr/bin/env bash
# Decode speed on one H200 (device tool, kind nvidia-h200): the GPU tests of the decode path, then
# the real-shape V2-Lite synthetic compiled bf16 and --fp8, measured in process by `mlac bench`
# with and without CUDA graphs (each with a profile of decode steps).
# $OUT: bench_*.json, tests.txt, log.txt. Set SKIP_TESTS=1 to leave the tests out.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 &
SYNTH=$!
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/runtime/worker/test_graphs.py tests/kernels/test_mla_prep.py \
    tests/kernels/test_activation.py tests/kernels/test_moe_routing.py tests/kernels/test_norm_rope.py tests/runtime/test_gpu_e2e.py} \
    >"$OUT/tests.txt" 2>&1; stamp "gpu tests rc=$?"; tail -5 "$OUT/tests.txt"
fi
wait $SYNTH || { tail -5 $W/synth.log; exit 1; }; stamp synth
python3 -m mlac.cli compile $C $W/bf16 --skip-accuracy-check >$W/c1.log 2>&1 &
C1=$!
python3 -m mlac.cli compile $C $W/fp8 --fp8 --skip-accuracy-check >$W/c2.log 2>&1 &
C2=$!
wait $C1 || { tail -5 $W/c1.log; exit 1; }; stamp "compile bf16"
B="python3 -m mlac.cli bench --no-verify --input-len 64 --output-len 64"
$B $W/bf16 --batch-sizes ${BATCHES:-1,32,256} --profile --json "$OUT/bench_bf16_graphs.json"; stamp "bench bf16 graphs rc=$?"
[ -n "${EAGER:-}" ] && { $B $W/bf16 --batch-sizes 1,32 --no-cuda-graph --profile --json "$OUT/bench_bf16_eager.json"; stamp "bench bf16 eager rc=$?"; }
wait $C2 || { tail -5 $W/c2.log; exit 1; }; stamp "compile fp8"; rm -rf $C
$B $W/fp8 --batch-sizes ${BATCHES:-1,32,256} --profile --json "$OUT/bench_fp8_graphs.json"; stamp "bench fp8 graphs rc=$?"
if [ -n "${LOAD:-}" ]; then  # the load phase alone: page cache warm (just written), then cold
  python3 benchmarks/load_gpu.py $W/bf16 --threads 8 --repeat 2 --json "$OUT/load_bf16_warm.json" | tail -3
  python3 benchmarks/load_gpu.py $W/bf16 --threads 8 --drop-cache --json "$OUT/load_bf16_cold.json" | tail -3
  stamp load
fi
if [ -n "${SERVE:-}" ]; then  # the end-to-end yardstick over HTTP
  for art in $SERVE; do
    timeout -k 10 ${SERVE_S:-150} python3 benchmarks/serve_gpu.py $W/$art --device cuda --json "$OUT/serve_$art.json" \
      --log $W/serve-$art.log --batches 1,32,256 --prompt-len 64 --max-tokens 64 --peak-requests 1024 \
      --peak-prompt-len 128 --peak-max-tokens 128 --max-running-requests 256 --max-queue 1024 \
      --serve-args "--no-verify --kv-cache-bytes 17179869184" --budget-s $(( ${SERVE_S:-150} - 10 ))
    stamp "serve $art rc=$?"; grep -i "error\|Traceback" $W/serve-$art.log | tail -3
  done
fi
