#!/usr/bin/env bash
# A small trained model and what each compile option costs it, on one GPU, from the repository root:
#
#     bash benchmarks/train/train.sh OUT_DIR
#
#   1. train_small.py --config $CONFIG (small) --device cuda --minutes $MINUTES (3; the clock stops it);
#   2. train_eval.py: the perplexity-delta table (bf16, --fp8, FP8 KV cache e4m3/e5m2 with scales 1.0 and
#      calibrated, on the GPU in bf16; bf16-cpu and --tp 2 on CPU in float32, gloo), each row compiled by
#      `mlac compile` and scored by `mlac eval` against the bf16 row;
#   3. `mlac generate` greedy of a Python prompt on the compiled bf16 artifact.
# The whole run takes at most BUDGET seconds (550); each stage gets what is left of it, and a stage cut short
# keeps what it wrote (the table is written after every row).
# OUT_DIR: log.txt; train/table.md, table.json, train_report.json, meta.tar.gz (config.json, tokenizer files,
# generation_config.json, greedy.txt, each row's eval record and logs). The checkpoint stays in $W/ckpt.
# CONFIG=micro DEVICE=cpu runs the same stages on a CPU (a smoke test).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/train/train.sh OUT_DIR}
. benchmarks/gpu_env.sh  # log, wheels, env, W and C, GPUs, stamp
T="$OUT/train"; mkdir -p "$T"
python3 -c "import torch, transformers, tokenizers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)"
BUDGET=${BUDGET:-550}; MINUTES=${MINUTES:-3}; CONFIG=${CONFIG:-small}; DEVICE=${DEVICE:-cuda}
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }  # seconds of the budget still unspent

# 1. train: the clock stops training after MINUTES; data, tokenizer, held-out eval and writing come around it
timeout $(( $(left) - 200 )) python3 benchmarks/train/train_small.py $W/ckpt --config $CONFIG --device $DEVICE \
  --minutes "$MINUTES" --seed 0
stamp "train rc=$?"
[ -f $W/ckpt/train_report.json ] || { echo "no checkpoint: stopping"; exit 1; }
cp $W/ckpt/train_report.json "$T/"
python3 - $W/ckpt/train_report.json <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
for k in ("parameters", "parameters_main", "experts_implementation", "steps", "steps_planned", "tokens",
          "seconds", "tokens_per_s", "held_out_perplexity", "unigram_perplexity", "held_out_mtp_loss"):
    print(f"{k}: {r.get(k)}")
print("greedy (transformers):", repr(r["greedy_continuation"]))  # the prompt included
EOF

# 2. the table (each row: compile through the CLI, then `mlac eval`)
timeout $(( $(left) - 45 )) python3 benchmarks/train/train_eval.py $W/ckpt $W/table --device $DEVICE \
  --max-tokens ${MAX_TOKENS:-16384} --cpu-max-tokens ${CPU_TOKENS:-2048} --top1-tokens ${TOP1_TOKENS:-8192}
stamp "train_eval rc=$?"
cp $W/table/table.md $W/table/table.json "$T/" 2>/dev/null

# 3. greedy generation through mlac's runtime, on the compiled bf16 artifact
if [ -d $W/table/art/bf16 ]; then
  timeout $(( $(left) - 15 )) python3 -m mlac.cli generate $W/table/art/bf16 --device $DEVICE --temperature 0 \
    --max-tokens 64 --prompt "$(printf 'import os\n\n\ndef read_lines(path):\n    ')" | tee $W/greedy.txt
  stamp "generate rc=$?"
fi

# 4. the checkpoint's small files and the eval records
tar -czf "$T/meta.tar.gz" -C $W/ckpt config.json tokenizer.json tokenizer_config.json generation_config.json \
  -C $W $(cd $W && ls greedy.txt 2>/dev/null) -C $W/table $(cd $W/table && ls -d eval logs 2>/dev/null)
ls -la "$T"; cat "$T/table.md" 2>/dev/null
stamp done
