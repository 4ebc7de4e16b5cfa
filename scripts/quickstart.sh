#!/usr/bin/env bash
# Set up (if needed), then the main job on a built-in default:
#   mlac demo: synthesize the tiny V3-shaped model (FP8, as DeepSeek-V3 is released), compile it
#   with --tp 2 --fp8, serve it on CPU (2 ranks), send one chat request over HTTP, shut down.
# Then the same artifact through the offline commands: inspect, verify, generate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
work=${1:-quickstart}
mlac demo --work "$work"
mlac inspect "$work/tiny-v3-tp2-fp8"
mlac verify "$work/tiny-v3-tp2-fp8"
mlac generate "$work/tiny-v3-tp2-fp8" --prompt "The quick brown fox" --max-tokens 16
