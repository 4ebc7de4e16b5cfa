#!/usr/bin/env bash
# Speculative decoding at real V3 shapes on 2xH200 (device tool, kind nvidia-h200-x2): the V3
# synthetic cut to 2 layers plus its MTP layer (random weights: the acceptance says nothing),
# compiled --tp 2 --fp8 (FP8 source blocks kept), benchmarked without and with speculation to show
# that the path runs at that scale (NCCL collectives of the draft and verify graphs on both ranks).
# MLA_OUT_TOO=1 also benches it plain with MLAC_FUSED_MLA_OUT=0 (bench_v3_tp2_plain_no_fused_mla_out.json).
# $OUT: bench_*.json, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
python3 -m mlac.cli synth --from-config tests/configs/DeepSeek-V3.json $C --num-layers 2 >$W/synth.log 2>&1 \
  || { tail -5 $W/synth.log; exit 1; }; stamp synth
python3 -m mlac.cli compile $C $W/tp2 --tp 2 --fp8 --skip-accuracy-check >$W/c.log 2>&1 || { tail -5 $W/c.log; exit 1; }
rm -rf $C; python3 -m mlac.cli inspect $W/tp2 | grep -E "^(mtp|plan|quantization)"; stamp compile
B="python3 -m mlac.cli bench --no-verify --input-len 64 --output-len 64 --batch-sizes ${BATCHES:-1,32}"
$B $W/tp2 --profile --json "$OUT/bench_v3_tp2_plain.json"; stamp "bench plain rc=$?"
if [ -n "${MLA_OUT_TOO:-}" ]; then
  MLAC_FUSED_MLA_OUT=0 $B $W/tp2 --json "$OUT/bench_v3_tp2_plain_no_fused_mla_out.json"; stamp "bench plain, MLAC_FUSED_MLA_OUT=0 rc=$?"
fi
$B $W/tp2 --profile --speculative-num-steps ${STEPS:-3} --json "$OUT/bench_v3_tp2_spec.json"; stamp "bench spec rc=$?"
