#!/usr/bin/env bash
# The MoE decode kernel's tiles at batch 1 on one H200 (device tool, kind nvidia-h200): sweep the decode
# configs of one V2-Lite MoE layer with its shared experts (bench_moe_shared.py --sweep), then measure the
# fastest FP8 and bf16 configs inside the whole decode step (`mlac bench`, batch 1 and 32) against the
# defaults, through MLAC_MOE_DECODE_CONFIG. The real-shape V2-Lite synthetic is made and compiled (bf16 and
# --fp8) while the sweep runs. $OUT: moe_shared_sweep.json, bench_{fp8,bf16}_{default,best}.json, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
( python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 \
  && { python3 -m mlac.cli compile $C $W/bf16 --skip-accuracy-check >$W/c1.log 2>&1 &
       python3 -m mlac.cli compile $C $W/fp8 --fp8 --skip-accuracy-check >$W/c2.log 2>&1; wait; } ) &
BUILD=$!
python3 benchmarks/bench_moe_shared.py --sweep --shapes v2lite --out "$OUT/moe_shared_sweep.json"; stamp "sweep rc=$?"
BEST=$(python3 - "$OUT/moe_shared_sweep.json" <<'P'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
print(json.dumps({("fp8" if r["fp8"] else "bf16"): r["inside_sweep"][0]["config"] for r in rows if r["inside_sweep"]}))
P
)
echo "fastest: $BEST"
wait $BUILD; stamp "synth + compile rc=$?"; tail -n 2 $W/c1.log $W/c2.log; rm -rf $C
B="python3 -m mlac.cli bench --no-verify --input-len 64 --output-len 64 --batch-sizes ${BATCHES:-1,32} --profile"
for art in fp8 bf16; do
  $B $W/$art --json "$OUT/bench_${art}_default.json"; stamp "bench $art default rc=$?"
  MLAC_MOE_DECODE_CONFIG="$BEST" $B $W/$art --json "$OUT/bench_${art}_best.json"; stamp "bench $art fastest rc=$?"
done
