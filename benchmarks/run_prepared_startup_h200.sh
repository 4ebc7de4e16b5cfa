#!/usr/bin/env bash
# One H200 (device tool, kind nvidia-h200): the start-up of a prepared bf16 V2-Lite from a fresh process,
# empty ~/.triton, TRITON_CACHE_DIR unset, hashes verified, --require-prepared (serve_gpu.py: start-up,
# then decode at batch 1 and 32 counting JIT compiles). Reuses $W/bf16 when an earlier script on the same
# machine compiled it (run_e2e_h200.sh), else synthesizes and compiles it.
# Env: A/B of the load overlapping the graph capture: LOAD_OVERLAP_AB=1 also starts with MLAC_LOAD_OVERLAP=0;
# PREFIX_TOO=1 then runs prefix_ttft.py on the prepared artifact (--require-prepared: no kernel compiles inside
# its timings), suffixes ${SUFFIX_LENS:-8,16,64}; WORKLOAD_TOO=1 runs prefix_workload.py (the shared-system-prompt
# workload at concurrency 1, 4, 16, 64, the radix cache off then on; one token per request, then 32 at 16 and 64).
# $OUT: prepare.txt, serve_prepared.json (+ serve_prepared_no_overlap.json, prefix_ttft.json,
# prefix_workload{,_out32}.json with their servers' logs), log.txt.
set -uo pipefail
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
if [ ! -f $W/bf16/manifest.sha256 ]; then
  python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 || { tail -5 $W/synth.log; exit 1; }
  python3 -m mlac.cli compile $C $W/bf16 --skip-accuracy-check >$W/c1.log 2>&1 || { tail -5 $W/c1.log; exit 1; }
  rm -rf $C; stamp "synth + compile"
fi
timeout 170 python3 -m mlac.cli prepare $W/bf16 --device cuda --max-running-requests 256 2>&1 | tail -3 | tee "$OUT/prepare.txt"
stamp prepare
serve() {  # serve NAME [env...]
  local name=$1; shift
  rm -rf ~/.triton; unset TRITON_CACHE_DIR
  env "$@" timeout -k 10 90 python3 benchmarks/serve_gpu.py $W/bf16 --device cuda --json "$OUT/$name.json" \
    --log $W/$name.log --batches 1,32 --prompt-len 64 --max-tokens 64 --peak-requests 0 \
    --max-running-requests 256 --max-queue 1024 --serve-args=--require-prepared --budget-s 80 | tail -1
  stamp "serve $name rc=$?"; grep -i "ready in\|kernel cache\|error" $W/$name.log | head -5
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("startup", d.get("startup"))
for k, v in (d.get("decode") or {}).items():
    print(k, {x: v.get(x) for x in ("decode_tokens_per_s", "server_triton_jit_compiles", "server_generation_tokens")})
PY
}
serve serve_prepared MLAC_UNUSED=0
[ -n "${LOAD_OVERLAP_AB:-}" ] && serve serve_prepared_no_overlap MLAC_LOAD_OVERLAP=0
if [ -n "${PREFIX_TOO:-}" ]; then
  timeout -k 10 200 python3 benchmarks/prefix_ttft.py $W/bf16 --device cuda --log $W/prefix.log \
    --serve-args "--no-verify --require-prepared --kv-cache-bytes 17179869184" --suffix-lens ${SUFFIX_LENS:-8,16,64} \
    --json "$OUT/prefix_ttft.json" | grep -E "ttft_ms_p50|speedup|in_process_ms|overhead"
  stamp "prefix rc=$?"
fi
if [ -n "${WORKLOAD_TOO:-}" ]; then
  WL=(python3 benchmarks/prefix_workload.py $W/bf16 --device cuda
      --serve-args "--no-verify --require-prepared --kv-cache-bytes 17179869184")
  timeout -k 10 240 "${WL[@]}" --json "$OUT/prefix_workload.json" | grep -v "^+"; stamp "workload rc=$?"
  timeout -k 10 200 "${WL[@]}" --max-tokens 32 --concurrency 16,64 --json "$OUT/prefix_workload_out32.json" \
    | grep -v "^+"; stamp "workload out32 rc=$?"
fi
