#!/usr/bin/env bash
# --attention-backend triton against flashinfer on one GPU machine, from the repository root:
#
#     bash benchmarks/e2e/attention_backend.sh OUT_DIR
#
# 1. The wheels of .whl-peers/ (flashinfer-python 0.6.11, JIT-only, and what it imports that the image lacks:
#    apache-tvm-ffi, ninja, nvidia-ml-py, einops, tabulate) go into /tmp/site-peers, as benchmarks/kernels/mla_peers.sh
#    installs them; FlashInfer's JIT workspace of the tests is /tmp/flashinfer-jit.
# 2. Meanwhile `mlac synth v2-lite` and its bf16 compile (CPU) run in the background, the GPU tests of the backend
#    (tests/runtime/worker/test_attention_backend_gpu.py: the Triton path's greedy tokens and decode logits, eager
#    and with CUDA graphs, over shared prefix blocks; a prepared artifact starting with no JIT compile under
#    --require-prepared)                                                     -> gpu_tests.txt
# 3. `mlac prepare` of V2-Lite for both backends (one unit: Triton's kernels and FlashInfer's MLA modules).
# 4. `mlac bench --require-prepared` per backend: batch 1, 32, 256, INPUT_LEN prompt tokens (1024) + 64 generated
#                                                                            -> bench_{triton,flashinfer}.json
#    and the decode tok/s of the two side by side                            -> attention_backend.json
# Under 540 s on one H100: build ~2 min beside the GPU tests (~4 min), prepare ~2 min, the benches ~1 min.
# Env: INPUT_LEN, W and C (gpu_env.sh); an artifact already in $W/fi-bf16 (a manifest there) is reused.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/e2e/attention_backend.sh OUT_DIR}
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
. benchmarks/peers_env.sh  # FlashInfer's wheels, JIT workspace, nvcc
python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' || { echo "flashinfer does not import"; exit 1; }
A=$W/fi-bf16
INPUT_LEN=${INPUT_LEN:-1024}

# 2. build in the background, GPU tests meanwhile
build() {
  python3 -m mlac.cli synth v2-lite $C >$W/synth.log 2>&1 || { tail -5 $W/synth.log; return 1; }
  python3 -m mlac.cli compile $C $A --skip-accuracy-check >$W/compile.log 2>&1 || { tail -5 $W/compile.log; return 1; }
  rm -rf $C
}
BUILD=""
if [ ! -f $A/manifest.json ]; then build & BUILD=$!; fi
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short tests/kernels/test_flashinfer_mla.py \
  tests/runtime/worker/test_attention_backend_gpu.py \
  >"$OUT/gpu_tests.txt" 2>&1
stamp "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)|Error" "$OUT/gpu_tests.txt" | head -20; tail -n 3 "$OUT/gpu_tests.txt"
if [ -n "$BUILD" ]; then wait $BUILD || exit 1; stamp "synth + compile v2-lite bf16"; fi

# 3. one unit for both backends
timeout 240 python3 -m mlac.cli prepare $A --device cuda --max-running-requests 256 \
  --attention-backend triton --attention-backend flashinfer 2>&1 | tail -2
stamp "prepare (triton + flashinfer)"

# 4. the benches
for b in triton flashinfer; do
  timeout 150 python3 -m mlac.cli bench $A --no-verify --require-prepared --attention-backend $b --batch-sizes 1,32,256 \
    --input-len $INPUT_LEN --output-len 64 --json "$OUT/bench_$b.json" 2>&1 | grep -v Warn | tail -6
  stamp "bench $b"
done
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {b: json.loads((out / f"bench_{b}.json").read_text()) for b in ("triton", "flashinfer") if (out / f"bench_{b}.json").is_file()}
if len(runs) == 2:
    by = {b: {r["batch"]: r for r in run["results"]} for b, run in runs.items()}
    rows = [dict(batch=n, context=r["input_len"] + r["output_len"], triton_decode_tok_s=r["decode_tokens_per_s"],
                 flashinfer_decode_tok_s=by["flashinfer"][n]["decode_tokens_per_s"],
                 flashinfer_over_triton=round(by["flashinfer"][n]["decode_tokens_per_s"] / r["decode_tokens_per_s"], 3))
            for n, r in sorted(by["triton"].items()) if n in by["flashinfer"]]
    record = dict(benchmark="mlac bench: decode tok/s, --attention-backend triton vs flashinfer",
                  device=runs["triton"]["device"], model="v2-lite bf16 (synthetic)", rows=rows)
    (out / "attention_backend.json").write_text(json.dumps(record, indent=2) + "\n")
    for r in rows:
        print(f"batch {r['batch']:4}: triton {r['triton_decode_tok_s']:9.1f} tok/s, flashinfer "
              f"{r['flashinfer_decode_tok_s']:9.1f} tok/s ({r['flashinfer_over_triton']:.2f}x)")
EOF
stamp "done"
