#!/usr/bin/env bash
# The prefix cache's time to first token on one H200 (device tool, kind nvidia-h200), V2-Lite real-shape
# synthetic bf16 (and --fp8 for the decode check): while the checkpoint is made and compiled, the GPU tests of
# the grouped MLA decode rows and the graphs, and bench_mla_rows.py (grouped against per-row); then
# profile_prefill.py (cold short, cold long, cached prefix; also under MLAC_PDL=0), prefix_ttft.py with a suffix
# sweep and its in-process step times (also under MLAC_MLA_ROW_GROUPS=0), and `mlac bench` at batch 1 and 32.
# $OUT: gpu_tests.txt, mla_rows.json, profile_prefill{,_pdl0}.json, prefix_ttft{,_nogroups}.json,
# bench_{bf16,fp8}.json, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
git log --oneline -1 2>/dev/null
( python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 \
  && { python3 -m mlac.cli compile $C $W/bf16 --skip-accuracy-check >$W/c1.log 2>&1 &
       python3 -m mlac.cli compile $C $W/fp8 --fp8 --skip-accuracy-check >$W/c2.log 2>&1; wait; } ) &
BUILD=$!
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_mla_decode_rows.py tests/runtime/worker/test_graphs.py \
  >"$OUT/gpu_tests.txt" 2>&1; stamp "gpu tests rc=$?"; tail -n 3 "$OUT/gpu_tests.txt"
python3 benchmarks/bench_mla_rows.py --json "$OUT/mla_rows.json"; stamp "mla rows rc=$?"
wait $BUILD; stamp "synth + compile rc=$?"; tail -n 2 $W/c1.log $W/c2.log; rm -rf $C
P="python3 benchmarks/profile_prefill.py $W/bf16"
$P --json "$OUT/profile_prefill.json" | grep -E "^(cold|cached)"; stamp "profile prefill rc=$?"
MLAC_PDL=0 $P --json "$OUT/profile_prefill_pdl0.json" | grep -E "^(cold|cached)"; stamp "profile prefill MLAC_PDL=0 rc=$?"
T=(python3 benchmarks/prefix_ttft.py $W/bf16 --device cuda --log $W/prefix.log
   --serve-args "--no-verify --kv-cache-bytes 17179869184")
timeout -k 10 200 "${T[@]}" --suffix-lens 8,16,64 --json "$OUT/prefix_ttft.json" | grep -E "ttft_ms_p50|speedup|step_ms"
stamp "prefix rc=$?"
MLAC_MLA_ROW_GROUPS=0 timeout -k 10 120 "${T[@]}" --no-in-process --json "$OUT/prefix_ttft_nogroups.json" \
  | grep -E "ttft_ms_p50|speedup"; stamp "prefix MLAC_MLA_ROW_GROUPS=0 rc=$?"
for a in bf16 fp8; do
  python3 -m mlac.cli bench --no-verify --input-len 64 --output-len 64 $W/$a --batch-sizes 1,32 \
    --json "$OUT/bench_$a.json" 2>&1 | grep -v Warn | tail -n 4; stamp "bench $a"
done
