#!/usr/bin/env bash
# A/B of the fused decode launches on one H200 (device tool, kind nvidia-h200), V2-Lite real-shape synthetic,
# bf16 and --fp8: the kernel benchmarks of each fusion (bench_moe_shared.py, bench_router.py, bench_mla_out.py),
# then `mlac bench` at batch 1 and 32 with each fusion switched off in turn, and the FP8 skinny GEMM switched on
# (MLAC_SKINNY_GEMM=fp8). Env: GPU_TESTS (GPU-marked test files to run first). Artifacts in $W (reused when there).
# $OUT: moe_shared.json, router.json, mla_out.json, bench_<art>_<setting>.json, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
git log --oneline -1 2>/dev/null
if [ -n "${GPU_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS >"$OUT/gpu_tests.txt" 2>&1
  stamp "gpu tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/gpu_tests.txt" | tail -5
fi
for b in moe_shared router mla_out; do
  timeout 90 python3 benchmarks/bench_$b.py --out "$OUT/$b.json" >"$OUT/$b.txt" 2>&1; stamp "bench_$b rc=$?"
  grep -v Warn "$OUT/$b.txt" | tail -12
done
if [ ! -f $W/fp8/manifest.sha256 ]; then
  python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 || { tail -5 $W/synth.log; exit 1; }; stamp synth
  python3 -m mlac.cli compile $C $W/bf16 --skip-accuracy-check >$W/c-bf16.log 2>&1 & p1=$!
  python3 -m mlac.cli compile $C $W/fp8 --fp8 --skip-accuracy-check >$W/c-fp8.log 2>&1 & p2=$!
  wait $p1 && wait $p2 || { tail -5 $W/c-*.log; exit 1; }
  rm -rf $C; stamp "compile bf16 fp8"
fi
B="python3 -m mlac.cli bench --no-verify --input-len 64 --output-len 64 --batch-sizes 1,32"
for a in fp8 bf16; do
  for e in on MLAC_MOE_SHARED_FUSED=0 MLAC_ROUTER_KERNEL=0 MLAC_FUSED_MLA_OUT=0 MLAC_SKINNY_GEMM=fp8; do
    [ $a = bf16 ] && [ $e = MLAC_SKINNY_GEMM=fp8 ] && continue
    s=${e//=/}; env ${e/on/MLAC_AB=on} $B $W/$a --json "$OUT/bench_${a}_$s.json" 2>&1 | grep -E "^ +(1|32) "
    stamp "bench $a $e"
  done
done
