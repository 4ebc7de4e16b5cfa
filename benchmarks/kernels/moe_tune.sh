#!/usr/bin/env bash
# The MoE decode kernel's tiles for this GPU, at batch 1, from the repository root:
#
#     bash benchmarks/kernels/moe_tune.sh OUT_DIR
#
# 1. moe_decode.py --shared --sweep --shapes v2lite: one V2-Lite MoE layer with its shared experts inside the
#    decode launches, under every decode config of the sweep (us per call against the device-copy ceiling),
#    while the real-shape V2-Lite synthetic is made and compiled (bf16 and --fp8);
# 2. the fastest FP8 and bf16 configs inside the whole decode step (`mlac bench`, batch 1 and 32, through
#    MLAC_MOE_DECODE_CONFIG) against the defaults.
# Keep a config (the decode kernel's table in mlac/kernels/moe/, or MLAC_MOE_DECODE_CONFIG on a server)
# only where the whole step is faster. W and C: gpu_env.sh.
# OUT_DIR: moe_shared_sweep.json, bench_{fp8,bf16}_{default,best}.json, log.txt.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/kernels/moe_tune.sh OUT_DIR}
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
( python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 \
  && { python3 -m mlac.cli compile $C $W/bf16 --skip-accuracy-check >$W/c1.log 2>&1 &
       python3 -m mlac.cli compile $C $W/fp8 --fp8 --skip-accuracy-check >$W/c2.log 2>&1; wait; } ) &
BUILD=$!
python3 benchmarks/kernels/moe_decode.py --shared --sweep --shapes v2lite --out "$OUT/moe_shared_sweep.json"
stamp "sweep rc=$?"
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
