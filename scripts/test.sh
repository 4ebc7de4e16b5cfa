#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider -m "not slow" "$@"
