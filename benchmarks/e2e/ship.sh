#!/usr/bin/env bash
# Shipping end to end on one GPU machine, through a real OCI registry on its localhost:
#
#     bash benchmarks/e2e/ship.sh OUT_DIR
#
# 1. The registry: the CNCF distribution registry (Debian's `docker-registry`: one static 20 MB binary; from
#    PATH, or REGISTRY_BIN), on 127.0.0.1:5000, storing in REGISTRY_DIR (default /dev/shm/registry: memory).
# 2. The CPU job's part: the artifact ($W/$ART, made here by `mlac synth` + `mlac compile` unless there)
#    pushed: `mlac push --json`                                               -> push.json (seconds, GB)
# 3. The GPU job's part: `mlac pull --target none` into a fresh folder, `mlac prepare --cache-out unit`,
#    `mlac push unit`: the unit's megabytes only                              -> pull.json, push_unit.json
# 4. The deploy: a fresh `mlac serve oci://... --require-prepared` from an EMPTY download folder and an
#    EMPTY Triton cache (serve_http.py): seconds from the process start to /health 200 WITH the pull inside
#    it, the pull's GB/s (the server's log line), decode at batch 1 and 32, and the Triton JIT compiles at
#    start and in the requests (0 expected: the unit was pulled with the artifact)      -> serve_oci.json
#
# The ceiling of the pull is the device copy of the same bytes from page cache (load.py in the yardstick);
# the registry here is local, so the numbers are mlac's client, not a network.
# Environment: ART (default bf16), SYNTH (default v2-lite), COMPILE_ARGS, W, C (gpu_env.sh), REGISTRY_BIN,
# REGISTRY_DIR, PULL_DIR (the GPU job's pull, default $W/pulled), SERVE_ARGS (more `mlac serve` flags),
# DROP_SOURCE=1 (remove $W/$ART once pushed: three copies of a large artifact may not fit one disk).
# About 5 minutes for V2-Lite bf16 on one H200.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/e2e/ship.sh OUT_DIR}
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
ART=${ART:-bf16}
REG_BIN=${REGISTRY_BIN:-$(command -v docker-registry || echo .bin/docker-registry)}
REG_DIR=${REGISTRY_DIR:-/dev/shm/registry}
REF=oci://127.0.0.1:5000/mlac/v2-lite:$ART
export MLAC_INSECURE_REGISTRIES=127.0.0.1:5000

mkdir -p "$REG_DIR"
cat >"$W/registry.yml" <<EOF
version: 0.1
log: {level: warn}
storage: {filesystem: {rootdirectory: $REG_DIR}}
http: {addr: 127.0.0.1:5000}
EOF
"$REG_BIN" serve "$W/registry.yml" >"$W/registry.log" 2>&1 &
REG_PID=$!
trap 'kill $REG_PID 2>/dev/null' EXIT
for _ in $(seq 50); do curl -sf http://127.0.0.1:5000/v2/ >/dev/null && break; sleep 0.1; done
stamp "registry up"

if [ ! -f "$W/$ART/manifest.json" ]; then
  flag=""; [ "$ART" = fp8 ] && flag=--fp8
  python3 -m mlac.cli synth ${SYNTH:-v2-lite} $C >$W/synth.log 2>&1 || { tail -3 $W/synth.log; exit 1; }
  # shellcheck disable=SC2086
  python3 -m mlac.cli compile $C $W/$ART $flag ${COMPILE_ARGS:-} --skip-accuracy-check >$W/compile.log 2>&1 \
    || { tail -3 $W/compile.log; exit 1; }
  rm -rf $C
  stamp "synth + compile $ART"
fi

python3 -m mlac.cli push --json $W/$ART $REF >"$OUT/push.json" || exit 1
[ -n "${DROP_SOURCE:-}" ] && rm -rf "$W/$ART"
stamp "push"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('bytes','seconds','uploaded_blobs')})" "$OUT/push.json"
PULLED=${PULL_DIR:-$W/pulled}
rm -rf $PULLED $W/unit
python3 -m mlac.cli pull --json --target none $REF $PULLED >"$OUT/pull.json" || exit 1
stamp "pull"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('downloaded_bytes','seconds','gb_per_s')})" "$OUT/pull.json"
rm -rf ~/.triton; unset TRITON_CACHE_DIR
timeout 300 python3 -m mlac.cli prepare $PULLED --device cuda --max-running-requests 256 --cache-out $W/unit | tail -1
stamp "prepare --cache-out"
python3 -m mlac.cli push --json $W/unit $REF >"$OUT/push_unit.json" || exit 1
stamp "push unit"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('bytes','units','seconds')})" "$OUT/push_unit.json"
rm -rf $PULLED $W/unit  # the deploy pulls its own copy

rm -rf ~/.triton "$W/store"; unset TRITON_CACHE_DIR
timeout -k 10 ${SERVE_S:-240} python3 benchmarks/e2e/serve_http.py $REF --device cuda --json "$OUT/serve_oci.json" \
  --log $W/serve-oci.log --batches 1,32 --prompt-len 64 --max-tokens 64 --peak-requests 0 \
  --max-running-requests 256 --serve-args="--download-dir $W/store --require-prepared ${SERVE_ARGS:-}" \
  --budget-s $(( ${SERVE_S:-240} - 10 )) | tail -1
stamp "serve oci:// rc=$?"
grep -E "pulled|kernel cache|error|Traceback" $W/serve-oci.log | head -5
python3 - "$OUT/serve_oci.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s = d.get("startup") or {}
print("ready_s", s.get("seconds_to_ready"), "phases", s.get("phases"))
for k, v in (d.get("decode") or {}).items():
    print(k, {x: v.get(x) for x in ("decode_tokens_per_s", "server_triton_jit_compiles")})
PY
