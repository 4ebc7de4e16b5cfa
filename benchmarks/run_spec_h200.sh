#!/usr/bin/env bash
# Speculative decoding with the MTP layer on one H200 (device tool, kind nvidia-h200): the GPU
# tests of the speculative path, then a trained model (benchmarks/train_small.py --config $CONFIG,
# or the checkpoint at $CKPT) compiled with its MTP layer, bf16 and --fp8, measured in process by
# `mlac bench` at batch 1, 8 and 32 without speculation and with --speculative-num-steps 1..3
# (each record holds the acceptance length, `accept_length`: tokens per sequence per verify step, the
# plain-decoding baseline of the same run, `plain_decode_tokens_per_s`, and under "profile" the
# kernels, graph replays, copies, GPU and wall ms of one step at batch 1).
# CONFIG (small): the train_small.py recipe; `deep` is as deep as V2-Lite (27 layers), where the MTP
# draft is 1/28 of the model, not 1/7 (`CONFIG=deep TRAIN_MIN=5` for issue #14's measurement). With
# CKPT set, CONFIG only names the output files. It is in every bench file's name and in log.txt.
# Env: CKPT (skip training), TRAIN_MIN (10), ARTS ("bf16 fp8"), STEPS ("1 2 3"), BATCHES, INPUT_LEN, OUTPUT_LEN,
# NO_OVERLAP_TOO (each K also with --disable-overlap-schedule: bench_${CONFIG}_${art}_k${K}_no_overlap.json),
# AB_ENV (each K also under this environment, e.g. AB_ENV=MLAC_MLA_ROW_GROUPS=0: bench_${CONFIG}_${art}_k${K}_ab.json),
# GPU_TESTS (the test files, default the speculative ones and test_graphs.py).
# $OUT: bench_${CONFIG}_{bf16,fp8}_{plain,k1,k2,k3}.json, tests.txt, train.log, train_report_$CONFIG.json, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
GPU_TESTS=${GPU_TESTS:-tests/runtime/engine/test_spec_decode.py tests/runtime/worker/test_spec_chain.py tests/runtime/engine/test_spec_overlap.py tests/runtime/worker/test_graphs.py}
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS \
  >"$OUT/tests.txt" 2>&1; stamp "gpu tests rc=$?"; tail -5 "$OUT/tests.txt"
CONFIG=${CONFIG:-small}; C=${CKPT:-$W/$CONFIG}; stamp "config $CONFIG, checkpoint $C"
if [ -z "${CKPT:-}" ]; then
  python3 benchmarks/train_small.py $C --config $CONFIG --device cuda --minutes ${TRAIN_MIN:-10} >"$OUT/train.log" 2>&1 \
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
    if [ -n "${AB_ENV:-}" ]; then
      env $AB_ENV $B $W/$art --speculative-num-steps $k --json "$OUT/bench_${CONFIG}_${art}_k${k}_ab.json"
      stamp "bench $CONFIG $art k=$k under $AB_ENV rc=$?"
    fi
  done
done
