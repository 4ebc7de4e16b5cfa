#!/usr/bin/env bash
# MTP speculative decoding on one GPU, from the repository root:
#
#     CONFIG=deep bash benchmarks/e2e/spec.sh OUT_DIR
#
# Random weights accept no drafts, so this measures a trained model: benchmarks/train/train_small.py --config
# $CONFIG (`deep`: 27 layers, as deep as V2-Lite, where the MTP draft is 1/28 of the model; `small`: 6 layers),
# trained TRAIN_MIN minutes here (or the checkpoint at $CKPT), compiled with its MTP layer, bf16 and --fp8, then
# `mlac bench` at batch 1, 8 and 32 without speculation and with --speculative-num-steps 1..3. Each record holds
# decode tok/s, the acceptance length (`accept_length`: tokens per sequence per verify step) and the plain
# decoding baseline of the same run (`plain_decode_tokens_per_s`); the speed-up is their ratio. Under "profile":
# the kernels, graph replays, GPU busy and wall ms of one step at batch 1. The GPU tests of the speculative path
# run first.
# Env: CONFIG (small), CKPT (skip training; CONFIG then only names the files), TRAIN_MIN (10), ARTS ("bf16 fp8"),
# STEPS ("1 2 3"), BATCHES (1,8,32), INPUT_LEN, OUTPUT_LEN (128), NO_OVERLAP_TOO=1 (each K also with
# --disable-overlap-schedule), GPU_TESTS (the test files; default the speculative ones and test_graphs.py).
# OUT_DIR: bench_${CONFIG}_{bf16,fp8}_{plain,k1,k2,k3}[_no_overlap].json, tests.txt, train.log,
# train_report_$CONFIG.json, log.txt.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/e2e/spec.sh OUT_DIR}
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
GPU_TESTS=${GPU_TESTS:-tests/runtime/engine/test_spec_decode.py tests/runtime/worker/test_spec_chain.py tests/runtime/engine/test_spec_overlap.py tests/runtime/worker/test_graphs.py}
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS \
  >"$OUT/tests.txt" 2>&1; stamp "gpu tests rc=$?"; tail -5 "$OUT/tests.txt"
CONFIG=${CONFIG:-small}; C=${CKPT:-$W/$CONFIG}; stamp "config $CONFIG, checkpoint $C"
if [ -z "${CKPT:-}" ]; then
  python3 benchmarks/train/train_small.py $C --config $CONFIG --device cuda --minutes ${TRAIN_MIN:-10} >"$OUT/train.log" 2>&1 \
    || { tail -5 "$OUT/train.log"; exit 1; }; cp $C/train_report.json "$OUT/train_report_$CONFIG.json"; stamp train
fi
python3 -m mlac.cli compile $C $W/bf16 >$W/c1.log 2>&1 || { tail -5 $W/c1.log; exit 1; }
[[ " ${ARTS:-bf16 fp8} " == *" fp8 "* ]] && { python3 -m mlac.cli compile $C $W/fp8 --fp8 >$W/c2.log 2>&1 || { tail -5 $W/c2.log; exit 1; }; }
python3 -m mlac.cli inspect $W/bf16 | grep -E "^(mtp|accuracy)"; stamp compile
B="python3 -m mlac.cli bench --no-verify --input-len ${INPUT_LEN:-128} --output-len ${OUTPUT_LEN:-128} --batch-sizes ${BATCHES:-1,8,32}"
for art in ${ARTS:-bf16 fp8}; do
  $B $W/$art --profile --json "$OUT/bench_${CONFIG}_${art}_plain.json"; stamp "bench $CONFIG $art plain rc=$?"
  for k in ${STEPS:-1 2 3}; do
    $B $W/$art --profile --speculative-num-steps $k --json "$OUT/bench_${CONFIG}_${art}_k$k.json"; stamp "bench $CONFIG $art k=$k rc=$?"
    if [ -n "${NO_OVERLAP_TOO:-}" ]; then
      $B $W/$art --speculative-num-steps $k --disable-overlap-schedule --json "$OUT/bench_${CONFIG}_${art}_k${k}_no_overlap.json"
      stamp "bench $CONFIG $art k=$k --disable-overlap-schedule rc=$?"
    fi
  done
done
