#!/usr/bin/env bash
# Multi-rank plans against one GPU (a V3-shaped model by default) on a 4-GPU machine, from the repository root:
#
#     bash benchmarks/e2e/multirank.sh OUT_DIR
#
#   1. synth a DeepSeek-V3-shaped checkpoint of 2 layers (FP8 as released; layer 0 dense, layer 1 MoE with
#      256 experts; the MTP layer kept out by the compiler): ~31 GB in $W;
#   2. compile it 4 ways at once: tp1 --fp8 (the reference), tp4 ep4 --fp8, tp4 --fp8 (experts sliced),
#      tp2 --fp8; ~16 GB each;
#   3. multirank.py --skip-decode: the logits of each multi-rank artifact against tp1's (rel_l2, top-1);
#   4. serve_http.py on tp4ep4, tp4 and tp2 (GPUs 0,1): `mlac serve --device cuda`, which starts its other
#      ranks itself (docs/multi_rank.md, "One machine"); start-up to /health 200, decode tok/s at batch
#      1/32/256, peak output tok/s of 1,024 requests.
# Every GPU-marked test runs on GPU 0 meanwhile (GPU_TESTS_S seconds, 0: not at all).
# The server needs fastapi, starlette, uvicorn and httpx (wheels in .whl/ on a host without an index).
# OUT_DIR: gpus.txt, steps.txt (each step: rc, seconds, limit), log.txt, gpu_e2e.json, multirank_v3.json,
# serve_v3_<plan>.json. The JSONs are rewritten after every phase, so a step cut off by its limit still
# leaves what it measured.
#
# The whole run ends within DEADLINE (545 s) whatever hangs: every step's cap shrinks to what is left less a
# reserve for the steps after it (tp2 last). Expected: synth 20-100 s, the 4 compiles together 60-150,
# logits 60-100, each serve 60-100 (start-up 15-40, decode 10-20, peak 20-60).
#
# On a 2-GPU machine: PLANS=tp2 GPU_TESTS_S=0 bash benchmarks/e2e/multirank.sh OUT_DIR
# The V2-Lite real-shape synthetic instead: SYNTH=v2-lite PLANS=tp2 GPU_TESTS_S=0 bash benchmarks/e2e/multirank.sh OUT_DIR
# Smoke test on a CPU machine (tiny checkpoint, gloo, small sizes):
#   DEVICE=cpu SKIP_INSTALL=1 SYNTH=tiny-v3 SERVE_SIZES="--batches 1,4 --max-tokens 8 --prompt-len 16
#   --peak-requests 16 --peak-prompt-len 16 --peak-max-tokens 8" bash benchmarks/e2e/multirank.sh /tmp/o
set -uo pipefail
OUT=${1:?usage: bash benchmarks/e2e/multirank.sh OUT_DIR}
mkdir -p "$OUT"
T0=$(date +%s)
DEADLINE=$((T0 + ${DEADLINE_S:-545}))
exec > >(tee -a "$OUT/log.txt") 2>&1

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}
ulimit -n 65536 2>/dev/null || true  # 1024 streams in flight: a socket each, client and server
MLAC="python3 -m mlac.cli"
W=${W:-/tmp/w}
DEVICE=${DEVICE:-cuda}
PLANS=${PLANS:-"tp4ep4 tp4 tp2"} # which multi-rank artifacts to compile, compare and serve (tp1 always)
SYNTH=${SYNTH:-"--from-config tests/configs/DeepSeek-V3.json --num-layers 2"}
SERVE_SIZES=${SERVE_SIZES:-"--batches 1,32,256 --prompt-len 64 --max-tokens 64
  --peak-requests 1024 --peak-prompt-len 128 --peak-max-tokens 128"}
mkdir -p $W

left() { echo $((DEADLINE - $(date +%s))); }

# cap CAP RESERVE: CAP seconds, or what is left before DEADLINE less RESERVE if that is smaller
cap() {
  local s=$(($(left) - $2))
  ((s > $1)) && s=$1
  echo $((s < 0 ? 0 : s))
}

# step NAME SECONDS CMD...: CMD under `timeout` (rc 124: cut off; SIGKILL 20 s after the SIGTERM,
# time for serve_http.py to stop its server), its rc and time to steps.txt
step() {
  local name=$1 secs=$2 t rc
  shift 2
  if ((secs < 20)); then
    echo "$name: skipped, $secs s left" | tee -a "$OUT/steps.txt"
    return 1
  fi
  t=$(date +%s)
  time timeout -k 20 "$secs" "$@"
  rc=$?
  echo "$name: rc=$rc $(($(date +%s) - t)) s (limit $secs s, at $(($(date +%s) - T0)) s)" | tee -a "$OUT/steps.txt"
  return $rc
}

if [ -z "${SKIP_INSTALL:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  nproc --all # (plain nproc answers OMP_NUM_THREADS)
  free -g | head -2
  df -h /tmp | tail -1
} 2>&1 | tee "$OUT/gpus.txt"
SERVE_DEPS=ok
python3 -c 'import pydantic, fastapi, starlette, uvicorn, httpx' || SERVE_DEPS=missing
echo "server deps (fastapi, starlette, uvicorn, httpx): $SERVE_DEPS" | tee -a "$OUT/steps.txt"

# ---- 0. every GPU-marked test on GPU 0, in the background while the CPUs synth and compile -----
# (kernels at real shapes; the runtime on CUDA against the CPU path: gpu_e2e.json). Its log goes
# into log.txt once it ends; it must end before the GPUs are used for logits.
if [ "${GPU_TESTS_S:-240}" -gt 0 ]; then
  CUDA_VISIBLE_DEVICES=0 MLAC_GPU_RESULTS=$OUT/gpu_e2e.json timeout -k 10 ${GPU_TESTS_S:-240} \
    python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m gpu tests/ >$W/gpu_tests.log 2>&1 &
  GPU_TESTS=$!
else
  echo "gpu tests: not run (GPU_TESTS_S=0)" >$W/gpu_tests.log
  GPU_TESTS=
fi

# ---- 1. synth (reserve: compiles 60 + logits 60 + serves 3 x 60) ------------------------------
# shellcheck disable=SC2086  # SYNTH: several words
step synth "$(cap 200 300)" $MLAC synth $SYNTH $W/ckpt >$W/synth.log 2>&1 || { tail -5 $W/synth.log; exit 1; }
tail -1 $W/synth.log
du -sh $W/ckpt

# ---- 2. four compiles at once (reserve: logits 60 + serves 3 x 60) -----------------------------
compile() { # compile NAME FLAGS...
  local name=$1
  shift
  step "compile $name" "$CAP" $MLAC compile $W/ckpt $W/$name "$@" --skip-accuracy-check >$W/compile-$name.log 2>&1
}
CAP=$(cap 260 240)
PIDS=()
compile tp1 --fp8 &
PIDS+=($!)
for name in $PLANS; do
  case $name in
    tp4ep4) compile tp4ep4 --tp 4 --ep 4 --fp8 & ;;
    tp4) compile tp4 --tp 4 --fp8 & ;;
    tp2) compile tp2 --tp 2 --fp8 & ;;
    *) echo "unknown plan $name"; exit 1 ;;
  esac
  PIDS+=($!)
done
wait "${PIDS[@]}"
for name in tp1 $PLANS; do
  echo "== compile $name"
  grep -E "^(source|wrote|error|Traceback)" $W/compile-$name.log | tail -4
done
grep "^compile" "$OUT/steps.txt"
du -sh $W/tp* 2>/dev/null
df -h /tmp | tail -1

if [ -n "$GPU_TESTS" ]; then
  wait $GPU_TESTS
  echo "gpu tests: rc=$? at $(($(date +%s) - T0)) s" | tee -a "$OUT/steps.txt"
fi
tail -40 $W/gpu_tests.log

# ---- 3. logits of each multi-rank artifact vs tp1 (reserve: serves 3 x 60) ---------------------
MANY=()
for name in $PLANS; do [ -f $W/$name/manifest.json ] && MANY+=($W/$name); done
if [ -f $W/tp1/manifest.json ] && ((${#MANY[@]})); then
  step logits "$(cap 120 180)" python3 benchmarks/e2e/multirank.py --skip-decode --device $DEVICE --one $W/tp1 \
    --many "${MANY[@]}" --json "$OUT/multirank_v3.json"
fi
rm -rf $W/tp1 $W/ckpt # disk and page cache back before serving

# ---- 4. serve each (reserve: the serves after it, 60 s each) ------------------------------------
# batch 256 and the peak run need --max-running-requests >= 256 (512 here: the peak run's batch);
# serve_http.py sizes --max-queue for the 1024 requests sent at once.
# shellcheck disable=SC2206  # SERVE_SIZES: several words
SERVE_FLAGS=(--device $DEVICE $SERVE_SIZES --max-running-requests 512 --startup-timeout 120 --phase-timeout 40
  --peak-timeout 60)
serve() { # serve NAME SECONDS [VAR=VALUE...]
  local name=$1 secs=$2
  shift 2
  [ -f $W/$name/manifest.json ] || { echo "serve $name: no artifact" | tee -a "$OUT/steps.txt"; return; }
  ((secs >= 60)) || { echo "serve $name: skipped, $secs s left" | tee -a "$OUT/steps.txt"; return; }
  step "serve $name" "$secs" env "$@" python3 benchmarks/e2e/serve_http.py $W/$name --json "$OUT/serve_v3_$name.json" \
    --log $W/serve-$name.log --pgid-file $W/serve.pgid --budget-s $((secs - 15)) "${SERVE_FLAGS[@]}"
  # serve_http.py stops its server; if it was SIGKILLed itself, its server's group is named here
  if [ -f $W/serve.pgid ]; then
    kill -9 -- "-$(cat $W/serve.pgid)" 2>/dev/null
    rm -f $W/serve.pgid
  fi
}
if [ $SERVE_DEPS = ok ]; then
  [[ " $PLANS " == *" tp4ep4 "* ]] && serve tp4ep4 "$(cap 150 120)"
  [[ " $PLANS " == *" tp4 "* ]] && serve tp4 "$(cap 150 60)"
  [[ " $PLANS " == *" tp2 "* ]] && serve tp2 "$(cap 150 0)" CUDA_VISIBLE_DEVICES=0,1
fi

echo "== end at $(($(date +%s) - T0)) s"
cat "$OUT/steps.txt"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv # empty: no server left behind
sleep 1 # tee writes the last lines of log.txt
