#!/usr/bin/env bash
# One H200 (device tool, kind nvidia-h200): the CUDA graphs' warm-runs at start-up, bucket by bucket
# (capture_breakdown.py). Synthesizes, compiles and prepares a bf16 V2-Lite (unless $W/bf16 is prepared),
# then, from an empty ~/.triton each time: the graphs after the load (MLAC_LOAD_OVERLAP=0), then with the
# overlap (the server's default). EXTRA: a command run at the end (an A/B of a change).
# $OUT: capture_{after_load,overlap}.json, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
[ -d $W/bf16/cache ] || prepared_bf16  # gpu_env.sh
for mode in after_load overlap; do
  rm -rf ~/.triton; unset TRITON_CACHE_DIR
  overlap=1; [ $mode = after_load ] && overlap=0
  MLAC_LOAD_OVERLAP=$overlap timeout 120 python3 benchmarks/capture_breakdown.py $W/bf16 --verify \
    --json "$OUT/capture_$mode.json" 2>&1 | tail -3
  stamp "capture_breakdown $mode rc=$?"
done
if [ -n "${EXTRA:-}" ]; then eval "$EXTRA"; stamp "extra rc=$?"; fi
