#!/usr/bin/env bash
# One 2xH200 call (device tool, kind nvidia-h200-x2) for two checks: (1) the V3 synthetic cut to 2 layers plus its
# MTP layer, --tp 2 --fp8: `mlac bench` plain (with and without MLAC_FUSED_MLA_OUT) and with speculation (K = 3;
# the one-graph chain over two ranks, random weights: acceptance says nothing); (2) the V2-Lite real-shape synthetic,
# bf16, --tp 1 and --tp 2, decode at batch 1 over HTTP (serve_gpu.py), multi-rank overlap on (the default).
# $OUT: bench_v3_tp2_*.json, serve_v2-lite_tp{1,2}.json, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
git log --oneline -1 2>/dev/null
C3=/dev/shm/v3; C2=/dev/shm/v2lite
python3 -m mlac.cli synth --from-config tests/configs/DeepSeek-V3.json $C3 --num-layers 2 >$W/s3.log 2>&1 &
S3=$!
python3 -m mlac.cli synth v2-lite $C2 >$W/s2.log 2>&1 || { tail -n 5 $W/s2.log; exit 1; }
wait $S3 || { tail -n 5 $W/s3.log; exit 1; }; stamp synth
python3 -m mlac.cli compile $C3 $W/v3 --tp 2 --fp8 --skip-accuracy-check >$W/c3.log 2>&1 & P3=$!
python3 -m mlac.cli compile $C2 $W/tp1 --skip-accuracy-check >$W/c1.log 2>&1 & P1=$!
python3 -m mlac.cli compile $C2 $W/tp2 --tp 2 --skip-accuracy-check >$W/c2.log 2>&1 & P2=$!
wait $P3 $P1 $P2 || { tail -n 3 $W/c*.log; exit 1; }
rm -rf $C3 $C2; stamp compile
B="python3 -m mlac.cli bench --no-verify --input-len 64 --output-len 64 --batch-sizes 1,32"
$B $W/v3 --profile --json "$OUT/bench_v3_tp2_plain.json" 2>&1 | grep -v Warn | tail -n 4; stamp "v3 plain"
MLAC_FUSED_MLA_OUT=0 $B $W/v3 --json "$OUT/bench_v3_tp2_plain_no_fused_mla_out.json" 2>&1 | grep -v Warn | tail -n 3
stamp "v3 plain MLAC_FUSED_MLA_OUT=0"
$B $W/v3 --profile --speculative-num-steps 3 --json "$OUT/bench_v3_tp2_spec3.json" 2>&1 | grep -v Warn | tail -n 4
stamp "v3 spec K=3"
for t in tp1 tp2; do
  timeout -k 10 100 python3 benchmarks/serve_gpu.py $W/$t --device cuda --json "$OUT/serve_v2-lite_$t.json" \
    --log $W/serve-$t.log --batches 1,32 --prompt-len 64 --max-tokens 64 --peak-requests 0 \
    --serve-args="--no-verify --kv-cache-bytes 17179869184" --budget-s 90 | tail -n 1
  stamp "serve $t rc=$?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], {k: v.get('decode_tokens_per_s') for k, v in d.get('decode', {}).items()})" "$OUT/serve_v2-lite_$t.json"
done
