#!/usr/bin/env bash
# Start-up of a prepared multi-rank artifact on a 2xH200 machine (device tool, kind nvidia-h200-x2): the
# real-shape V3 synthetic cut to 2 layers (plus its MTP layer), compiled bf16 --tp 2, prepared there
# (`mlac prepare`: every rank's kernels into the artifact's cache), then started by serve_gpu.py from a
# fresh process with an empty ~/.triton and TRITON_CACHE_DIR unset, hashes verified, --require-prepared;
# one decode phase (batch 1 and 32) counts the JIT compiles of the first requests.
# Env: W (work folder, default /tmp/wv3s). $OUT: serve_v3_tp2_prepared.json, prepare_v3.txt, log.txt.
set -uo pipefail
W=${W:-/tmp/wv3s}; C=${C3:-/dev/shm/ckpt-v3}
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
python3 -m mlac.cli synth --from-config tests/configs/DeepSeek-V3.json $C --num-layers 2 >$W/synth.log 2>&1 \
  || { tail -5 $W/synth.log; exit 1; }; stamp "synth v3 2 layers"
python3 -m mlac.cli compile $C $W/v3tp2 --tp 2 --skip-accuracy-check >$W/c.log 2>&1 || { tail -5 $W/c.log; exit 1; }
rm -rf $C; stamp "compile v3 tp2"
timeout 200 python3 -m mlac.cli prepare $W/v3tp2 --device cuda --max-running-requests 256 2>&1 | tail -3 \
  | tee "$OUT/prepare_v3.txt"; stamp prepare
rm -rf ~/.triton; unset TRITON_CACHE_DIR
timeout -k 10 120 python3 benchmarks/serve_gpu.py $W/v3tp2 --device cuda --json "$OUT/serve_v3_tp2_prepared.json" \
  --log "$OUT/serve-v3-tp2.log" --batches 1,32 --prompt-len 64 --max-tokens 64 --peak-requests 0 \
  --max-running-requests 256 --max-queue 1024 --serve-args=--require-prepared --budget-s 110 | tail -1
stamp "serve rc=$?"; grep -i "ready in\|kernel cache\|error" "$OUT/serve-v3-tp2.log" | head -5
python3 - "$OUT/serve_v3_tp2_prepared.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("startup", d.get("startup"))
for k, v in (d.get("decode") or {}).items():
    print(k, {x: v.get(x) for x in ("decode_tokens_per_s", "server_triton_jit_compiles", "server_generation_tokens")})
PY
