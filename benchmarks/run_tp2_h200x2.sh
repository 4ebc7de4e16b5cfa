#!/usr/bin/env bash
# `--tp 2` against one GPU on a 2xH200 machine (device tool, kind nvidia-h200-x2): the real-shape
# V2-Lite synthetic compiled bf16 at tp=1 and tp=2, each measured in process by `mlac bench` with
# CUDA graphs (NCCL all-reduces inside the graphs). Env: GLOO_TOO=1 also benches tp2 with its steps sent
# over gloo (MLAC_STEP_CHANNEL=gloo) instead of the shared-memory channel; OVERLAP_TOO=1 runs the 2-GPU test of
# multi-rank overlap scheduling and benches tp2 without it too (--disable-overlap-schedule, bench_tp2_no_overlap.json).
# $OUT: bench_tp*.json, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 || { tail -5 $W/synth.log; exit 1; }; stamp synth
python3 -m mlac.cli compile $C $W/tp1 --skip-accuracy-check >$W/c1.log 2>&1 &
P1=$!
python3 -m mlac.cli compile $C $W/tp2 --tp 2 --skip-accuracy-check >$W/c2.log 2>&1 &
P2=$!
wait $P1 $P2 || { tail -3 $W/c1.log $W/c2.log; exit 1; }  # not a bare `wait`: it would wait for tee too
stamp compile; rm -rf $C
B="python3 -m mlac.cli bench --no-verify --input-len 64 --output-len 64 --batch-sizes ${BATCHES:-1,32} --profile"
$B $W/tp1 --json "$OUT/bench_tp1.json"; stamp "bench tp1 rc=$?"
$B $W/tp2 --json "$OUT/bench_tp2.json"; stamp "bench tp2 rc=$?"
if [ -n "${GLOO_TOO:-}" ]; then
  MLAC_STEP_CHANNEL=gloo $B $W/tp2 --json "$OUT/bench_tp2_gloo.json"; stamp "bench tp2 over gloo rc=$?"
fi
if [ -n "${OVERLAP_TOO:-}" ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/dist/test_overlap_multirank_gpu.py 2>&1 | tail -3
  stamp "multi-rank overlap gpu test"
  $B $W/tp2 --disable-overlap-schedule --json "$OUT/bench_tp2_no_overlap.json"; stamp "bench tp2 without overlap rc=$?"
fi
