#!/usr/bin/env bash
# The end-to-end yardstick on one H200 (device tool, kind nvidia-h200), V2-Lite real-shape synthetic,
# bf16 and --fp8: `mlac bench` in process (with a decode profile at batch 1), `mlac serve` over HTTP
# (serve_gpu.py), the prefix cache's TTFT (prefix_ttft.py, bf16), the constrained sampler's
# overhead (constrained_overhead.py, bf16).
# Env: ARTS (default "bf16 fp8"), SKIP_PREFIX, SKIP_CONSTRAINED, SERVE_S (per serve run, default 110),
# GPU_TESTS (test files to run first, GPU-marked tests only), NO_OVERLAP_TOO (also bench each artifact
# with --disable-overlap-schedule: bench_<art>_no_overlap.json), AB_ENVS (space-separated env settings, e.g.
# "MLAC_PDL=0 MLAC_SKINNY_GEMM=0": each artifact is also benched at batch 1 and 32 with that one setting,
# bench_<art>_<setting>.json), SKIP_SERVE (no serve_gpu.py runs).
# $OUT: bench_<art>.json, serve_<art>.json, prefix_ttft.json, constrained.json, gpu_tests.txt, log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
git log --oneline -1 2>/dev/null
ARTS=${ARTS:-bf16 fp8}
if [ -n "${GPU_TESTS:-}" ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS >"$OUT/gpu_tests.txt" 2>&1
  stamp "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.txt"
fi
if [ ! -f $W/bf16/manifest.sha256 ]; then
  python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 || { tail -5 $W/synth.log; exit 1; }; stamp synth
  pids=()
  for a in $ARTS; do
    flag=""; [ $a = fp8 ] && flag=--fp8
    python3 -m mlac.cli compile $C $W/$a $flag --skip-accuracy-check >$W/c-$a.log 2>&1 & pids+=($!)
  done
  for p in "${pids[@]}"; do wait $p || { tail -5 $W/c-*.log; exit 1; }; done
  rm -rf $C; stamp "compile $ARTS"
fi
for a in $ARTS; do
  python3 -m mlac.cli bench --no-verify --input-len 64 --output-len 64 $W/$a --batch-sizes 1,32,256 --profile \
    --json "$OUT/bench_$a.json" 2>&1 | grep -v Warn | tail -7; stamp "bench $a"
  if [ -n "${NO_OVERLAP_TOO:-}" ]; then
    python3 -m mlac.cli bench --no-verify --input-len 64 --output-len 64 $W/$a --batch-sizes 1,32,256 \
      --disable-overlap-schedule --json "$OUT/bench_${a}_no_overlap.json" 2>&1 | grep -v Warn | tail -4
    stamp "bench $a --disable-overlap-schedule"
  fi
  for e in ${AB_ENVS:-}; do
    env "$e" python3 -m mlac.cli bench --no-verify --input-len 64 --output-len 64 $W/$a --batch-sizes 1,32 --profile \
      --json "$OUT/bench_${a}_${e}.json" 2>&1 | grep -v Warn | tail -4
    stamp "bench $a $e"
  done
  [ -n "${SKIP_SERVE:-}" ] && continue
  timeout -k 10 ${SERVE_S:-110} python3 benchmarks/serve_gpu.py $W/$a --device cuda --json "$OUT/serve_$a.json" \
    --log $W/serve-$a.log --batches 1,32,256 --prompt-len 64 --max-tokens 64 --peak-requests 1024 \
    --peak-prompt-len 128 --peak-max-tokens 128 --max-running-requests 256 --max-queue 1024 \
    --serve-args="--no-verify --kv-cache-bytes 17179869184" --budget-s $(( ${SERVE_S:-110} - 10 )) | tail -1
  stamp "serve $a rc=$?"; grep -i "error\|Traceback" $W/serve-$a.log | tail -3
  python3 - "$OUT/serve_$a.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1], {k: v.get("decode_tokens_per_s") for k, v in d.get("decode", {}).items()},
      "peak", (d.get("peak") or {}).get("output_tokens_per_s"), "ready_s", (d.get("startup") or {}).get("seconds_to_ready"))
PY
done
if [ -z "${SKIP_PREFIX:-}" ]; then
  timeout -k 10 120 python3 benchmarks/prefix_ttft.py $W/bf16 --device cuda --json "$OUT/prefix_ttft.json" \
    --log $W/prefix.log --serve-args "--no-verify --kv-cache-bytes 17179869184" | grep -E "ttft_ms_p50|speedup|per_s"
  stamp "prefix rc=$?"
fi
if [ -z "${SKIP_CONSTRAINED:-}" ]; then
  timeout -k 10 150 python3 benchmarks/constrained_overhead.py $W/bf16 --out "$OUT/constrained.json" 2>&1 | tail -8
  stamp "constrained rc=$?"
fi
