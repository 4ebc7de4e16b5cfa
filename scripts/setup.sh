#!/usr/bin/env bash
# Create .venv with mlac and its test dependencies (CPU). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"          # the CPU build; must come before anything that needs torch
python -m pip install -q "triton>=3.1" || echo "note: triton not installed; kernel interpreter tests will skip"
python -m pip install -q -e ".[test,serve]"
