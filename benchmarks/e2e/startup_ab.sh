#!/usr/bin/env bash
# Start to ready of this tree against another mlac source tree, on one GPU, from the repository root:
#
#     git worktree add /tmp/base REV      # the tree to compare with (any folder holding mlac/ works)
#     BASE=/tmp/base bash benchmarks/e2e/startup_ab.sh OUT
#
# A V2-Lite-shaped bf16 synthetic of LAYERS layers (4: the start-up's fixed costs, imports and graphs,
# with a small load) is compiled and prepared by each tree for this GPU (a tree reads its own
# artifacts), then each is served PAIRS times (3), the trees in turns, with --require-prepared and an
# empty Triton home (start_ready.py). OUT: startup_ab.json, log.txt, the servers' logs in OUT/logs.
set -uo pipefail
OUT=${1:?usage: BASE=DIR bash benchmarks/e2e/startup_ab.sh OUT}
BASE=$(cd "${BASE:?BASE: the other tree}" && pwd)
. benchmarks/gpu_env.sh  # log, wheels, PYTHONPATH, W and C, stamp
HERE=$PWD
python3 -m mlac.cli synth v2-lite "$C" --num-layers "${LAYERS:-4}" >"$W/synth.log" 2>&1 || { tail -3 "$W/synth.log"; exit 1; }
stamp synth
(cd "$BASE" && PYTHONPATH=/tmp/site:$BASE python3 -m mlac.cli compile "$C" "$W/base" --skip-accuracy-check >"$W/compile-base.log" 2>&1) &
BASE_COMPILE=$!
python3 -m mlac.cli compile "$C" "$W/this" --skip-accuracy-check >"$W/compile-this.log" 2>&1 || { tail -3 "$W/compile-this.log"; exit 1; }
wait $BASE_COMPILE || { tail -3 "$W/compile-base.log"; exit 1; }
rm -rf "$C"; stamp compiles
# one at a time: two prepares at once run out of GPU memory
(cd "$BASE" && TRITON_HOME=$(mktemp -d) PYTHONPATH=/tmp/site:$BASE python3 -m mlac.cli prepare "$W/base" --device cuda --max-running-requests 256 2>&1 | tail -1)
TRITON_HOME=$(mktemp -d) python3 -m mlac.cli prepare "$W/this" --device cuda --max-running-requests 256 2>&1 | tail -1
stamp prepares
python3 benchmarks/e2e/start_ready.py --tree "base=$BASE:$W/base" --tree "this=$HERE:$W/this" --pairs "${PAIRS:-3}" \
  --json "$OUT/startup_ab.json" --logs "$OUT/logs"
stamp starts
