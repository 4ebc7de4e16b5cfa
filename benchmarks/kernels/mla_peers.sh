#!/usr/bin/env bash
# mlac's MLA decode against FlashInfer's on one GPU (benchmarks/kernels/mla_peers.py), from the repository root:
#
#     bash benchmarks/kernels/mla_peers.sh OUT_DIR
#
# The wheels in .whl-peers/ (flashinfer-python, a JIT-only py3-none-any wheel, and what it imports that the
# image lacks: apache-tvm-ffi, ninja, nvidia-ml-py; einops, tabulate) go into /tmp/site-peers, apart from
# gpu_env.sh's /tmp/site (a second --target install there would replace its bin/). FlashInfer's JIT cache is
# under /tmp/flashinfer-jit: a fresh machine compiles its MLA modules in the run (seconds printed). Without
# those wheels, or where the compile fails, mla_peers.py says so in one line and times mlac alone.
# The whole call stays under 540 s: the rows get BUDGET_S (360) from the script's start, FlashInfer's build
# at most 300 of them, and `timeout` stops the script at 480 s (the JSON is written after every row).
# Env: BUDGET_S, ARGS (more mla_peers.py flags: --batches 1,32 --contexts 4096 ...).
# OUT_DIR: mla_peers.json, flashinfer_build_{auto,fa2}.log (each JIT build's own output), log.txt.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/kernels/mla_peers.sh OUT_DIR}
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
. benchmarks/peers_env.sh  # FlashInfer's wheels, JIT workspace, nvcc
timeout 480 python3 benchmarks/kernels/mla_peers.py --json "$OUT/mla_peers.json" --budget-s "${BUDGET_S:-360}" \
  --build-log "$OUT/flashinfer_build.log" ${ARGS:-}
stamp "mla_peers rc=$?"
