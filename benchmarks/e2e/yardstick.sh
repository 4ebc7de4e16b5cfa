#!/usr/bin/env bash
# The end-to-end yardstick, on one GPU machine, from the repository root:
#
#     bash benchmarks/e2e/yardstick.sh OUT_DIR
#
# 1. `mlac synth v2-lite` (the real-shape V2-Lite synthetic: 15.7B parameters, 27 layers, random weights),
#    compiled bf16 and --fp8 (ARTS), each artifact `mlac prepare`d for this GPU (every Triton kernel of the
#    CUDA-graph buckets and the warm-up shapes into the artifact's cache/<target>/). GPU_TESTS (GPU-marked test
#    files) run meanwhile, into OUT_DIR/gpu_tests.txt.
# 2. In process, per artifact: `mlac bench --batch-sizes 1,32,256 --profile`, 64 prompt + 64 output tokens:
#    prefill and decode tok/s per batch size against the bandwidth roofline that mlac bench measures in the
#    same run (the bytes a decode step must read over the device-to-device copy bandwidth), and a profile of
#    one decode step at batch 1 (kernels, GPU busy ms, wall ms)            -> bench_<art>.json
# 3. Over HTTP, per artifact (serve_http.py): a fresh `mlac serve --require-prepared` from an empty
#    ~/.triton: process start to the port and to the first /health 200, the start-up phases (import, load,
#    CUDA graphs, warm-up); decode tok/s at batch 1, 32, 256 (64 + 64 tokens, streamed); the peak output
#    tok/s of 1,024 requests of 128 + 128 tokens sent at once; Triton JIT compiles and preemptions in each
#    phase, from the server's /metrics (0 expected)                        -> serve_<art>.json
#
# Options (environment):
#   ARTS          artifacts to build and measure: "bf16 fp8" (default), "bf16", "fp8"
#   SYNTH         what `mlac synth` makes: "v2-lite" (default); for the V3-shaped 2-layer model:
#                 SYNTH="--from-config tests/configs/DeepSeek-V3.json --num-layers 2"
#   COMPILE_ARGS  more `mlac compile` flags, e.g. "--tp 2" or "--tp 2 --dp-attention" (multi-rank: run on a
#                 machine with that many GPUs; `mlac serve` starts the other ranks itself)
#   SERVE_ARGS    more `mlac serve` flags (default: --no-verify --kv-cache-bytes 17179869184; SERVE_ARGS="": none,
#                 so the hashes are verified and the KV cache comes from the memory plan)
#   MAX_RUNNING   --max-running-requests of the servers (256)
#   GPU_TESTS     GPU-marked test files to run while the checkpoint is made
#   SKIP_BENCH=1, SKIP_SERVE=1: leave step 2 or 3 out
#   SPEC_STEPS    also `mlac bench --speculative-num-steps SPEC_STEPS` (an artifact with an MTP layer; random
#                 weights accept no draft: this shows the path runs, benchmarks/e2e/spec.sh measures it)
#   LOAD=1        also the load phase alone (load.py, one rank, hashes verified): page cache warm, then cold
#   PREFIX=1      also the prefix cache on the bf16 artifact: prefix_ttft.py (a 2,000-token system prompt,
#                 suffixes of 8, 16, 64 tokens) and prefix_workload.py (concurrency 1, 4, 16, 64)
#   PROFILE=1     also profile_prefill.py (cold, cached, 4/16/32 cached suffixes in one step) and
#                 profile_startup.py (the imports, the load under cProfile) on the bf16 artifact
#   CONSTRAINED=1 also constrained_overhead.py (the JSON-schema sampler's ms per decode step) on bf16
#   PEAK_RUNNING  also the peak alone (1,024 requests of 128 + 128 tokens at once) served with each of these
#                 --max-running-requests, e.g. "256 512 1024" (MAX_RUNNING must be the largest: the artifact is
#                 prepared up to it), on the bf16 artifact: is there a cliff above the largest graph bucket?
#                 -> peak_<art>_<M>.json
#   W, C          the work folder (/tmp/w) and where the checkpoint is written (/dev/shm/ckpt): gpu_env.sh
# Artifacts already in $W/<art> (a manifest there) are reused: nothing is synthesized or compiled again.
# About 9 minutes for both artifacts on one H200 (synth and compiles ~2 min, prepare ~1 min each).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/e2e/yardstick.sh OUT_DIR}
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
ARTS=${ARTS:-bf16 fp8}
SERVE_ARGS=${SERVE_ARGS---no-verify --kv-cache-bytes 17179869184}  # set but empty: none
MAX_RUNNING=${MAX_RUNNING:-256}
E2E=benchmarks/e2e

# 1. build: synth and compile (GPU tests meanwhile), then prepare
build() {
  python3 -m mlac.cli synth ${SYNTH:-v2-lite} $C >$W/synth.log 2>&1 || { tail -5 $W/synth.log; return 1; }
  local pids=() a flag
  for a in $ARTS; do
    [ -f $W/$a/manifest.json ] && continue
    flag=""; [ $a = fp8 ] && flag=--fp8
    # shellcheck disable=SC2086
    python3 -m mlac.cli compile $C $W/$a $flag ${COMPILE_ARGS:-} --skip-accuracy-check >$W/compile-$a.log 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait $p || { tail -5 $W/compile-*.log; return 1; }; done
  rm -rf $C
}
need_build=""
for a in $ARTS; do [ -f $W/$a/manifest.json ] || need_build=1; done
if [ -n "$need_build" ]; then build & BUILD=$!; fi
if [ -n "${GPU_TESTS:-}" ]; then
  # shellcheck disable=SC2086
  timeout ${GPU_TESTS_S:-280} python3 -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS >"$OUT/gpu_tests.txt" 2>&1
  stamp "gpu tests rc=$?"; tail -n 3 "$OUT/gpu_tests.txt"
fi
if [ -n "$need_build" ]; then wait $BUILD || exit 1; stamp "synth + compile $ARTS"; fi
for a in $ARTS; do
  timeout 300 python3 -m mlac.cli prepare $W/$a --device cuda --max-running-requests $MAX_RUNNING 2>&1 | tail -1
  stamp "prepare $a"
done

# 2. in process
if [ -z "${SKIP_BENCH:-}" ]; then
  for a in $ARTS; do
    python3 -m mlac.cli bench $W/$a --no-verify --input-len 64 --output-len 64 --batch-sizes 1,32,256 --profile \
      --json "$OUT/bench_$a.json" 2>&1 | grep -v Warn | tail -6
    stamp "bench $a"
    if [ -n "${SPEC_STEPS:-}" ]; then
      python3 -m mlac.cli bench $W/$a --no-verify --input-len 64 --output-len 64 --batch-sizes 1,32 --profile \
        --speculative-num-steps $SPEC_STEPS --json "$OUT/bench_${a}_k$SPEC_STEPS.json" 2>&1 | grep -v Warn | tail -4
      stamp "bench $a K=$SPEC_STEPS"
    fi
  done
fi

# 3. over HTTP, each server a fresh process from an empty Triton cache: the prepared kernels only
if [ -z "${SKIP_SERVE:-}" ]; then
  for a in $ARTS; do
    rm -rf ~/.triton; unset TRITON_CACHE_DIR
    timeout -k 10 ${SERVE_S:-170} python3 $E2E/serve_http.py $W/$a --device cuda --json "$OUT/serve_$a.json" \
      --log $W/serve-$a.log --batches 1,32,256 --prompt-len 64 --max-tokens 64 --peak-requests 1024 \
      --peak-prompt-len 128 --peak-max-tokens 128 --max-running-requests $MAX_RUNNING --max-queue 1024 \
      --serve-args="$SERVE_ARGS --require-prepared" --budget-s $(( ${SERVE_S:-170} - 10 )) | tail -1
    stamp "serve $a rc=$?"; grep -i "error\|Traceback" $W/serve-$a.log | tail -3
    python3 - "$OUT/serve_$a.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s = d.get("startup") or {}
print("ready_s", s.get("seconds_to_ready"), "phases", s.get("phases"))
for k, v in (d.get("decode") or {}).items():
    print(k, {x: v.get(x) for x in ("decode_tokens_per_s", "ttft_ms_p50", "server_triton_jit_compiles", "server_num_preemptions")})
print("peak", {x: (d.get("peak") or {}).get(x) for x in ("output_tokens_per_s", "server_triton_jit_compiles")})
PY
  done
fi

# the optional parts, on the bf16 artifact (the first of ARTS when bf16 is not built)
A=bf16; [[ " $ARTS " == *" bf16 "* ]] || A=${ARTS%% *}
if [ -n "${LOAD:-}" ]; then
  python3 $E2E/load.py $W/$A --repeat 2 --json "$OUT/load_$A.json" | tail -3
  python3 $E2E/load.py $W/$A --drop-cache --json "$OUT/load_${A}_cold.json" | tail -3
  stamp load
fi
if [ -n "${PREFIX:-}" ]; then
  P=(--device cuda "--serve-args=$SERVE_ARGS --require-prepared")
  timeout -k 10 200 python3 $E2E/prefix_ttft.py $W/$A "${P[@]}" --log $W/prefix.log --suffix-lens 8,16,64 \
    --json "$OUT/prefix_ttft_$A.json" | grep -E "ttft_ms_p50|speedup"
  stamp "prefix_ttft rc=$?"
  timeout -k 10 240 python3 $E2E/prefix_workload.py $W/$A "${P[@]}" --json "$OUT/prefix_workload_$A.json" \
    | grep -v "^+" | tail -n 20
  stamp "prefix_workload rc=$?"
fi
if [ -n "${PROFILE:-}" ]; then
  timeout -k 10 200 python3 $E2E/profile_prefill.py $W/$A --json "$OUT/profile_prefill_$A.json" --batches 4,16,32 \
    | grep -E "^(cold|cached)"
  stamp "profile_prefill rc=$?"
  rm -rf ~/.triton; unset TRITON_CACHE_DIR
  mkdir -p "$OUT/startup_profile_$A"
  timeout 150 python3 $E2E/profile_startup.py $W/$A --device cuda --out "$OUT/startup_profile_$A" --verify
  stamp "profile_startup rc=$?"
fi
for m in ${PEAK_RUNNING:-}; do
  rm -rf ~/.triton; unset TRITON_CACHE_DIR
  timeout -k 10 ${SERVE_S:-170} python3 $E2E/serve_http.py $W/$A --device cuda --json "$OUT/peak_${A}_$m.json" \
    --log $W/peak-$m.log --batches "" --peak-requests 1024 --peak-prompt-len 128 --peak-max-tokens 128 \
    --max-running-requests $m --max-queue 1024 --serve-args="$SERVE_ARGS --require-prepared" \
    --budget-s $(( ${SERVE_S:-170} - 10 )) | tail -1
  python3 -c "import json, sys; p = json.load(open(sys.argv[1])).get('peak') or {}; print('peak at', sys.argv[2], \
    {k: p.get(k) for k in ('output_tokens_per_s', 'server_triton_jit_compiles', 'server_num_preemptions')})" \
    "$OUT/peak_${A}_$m.json" $m
  stamp "peak at --max-running-requests $m"
done
if [ -n "${CONSTRAINED:-}" ]; then
  timeout -k 10 150 python3 $E2E/constrained_overhead.py $W/$A --out "$OUT/constrained_overhead_$A.json" | tail -8
  stamp "constrained_overhead rc=$?"
fi
