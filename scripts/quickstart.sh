#!/usr/bin/env bash
# Set up (if needed), then the main job on a built-in default: synthesize the tiny V3-shaped
# model (FP8, as DeepSeek-V3 is released), compile it with --fp8, and generate on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
work=${1:-quickstart}
[ -f "$work/ckpt/config.json" ] || mlac synth tiny-v3 "$work/ckpt" --seed 0
mlac compile --fp8 --force "$work/ckpt" "$work/out"
mlac inspect "$work/out"
mlac verify "$work/out"
mlac generate "$work/out" --prompt "The quick brown fox" --max-tokens 24
