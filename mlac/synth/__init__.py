"""Synthetic Hugging Face DeepSeek checkpoints: real structure, random weights, a real tokenizer.

    synthesize(out_dir, preset="tiny-v3")            # or config_path="path/to/config.json"
    PRESETS                                          # preset name -> HF config.json dict
    weight_bytes(preset="v2-lite")                   # what synthesize() will write (progress total)

Layout: presets.py (the configs), weights.py (tensor list, random draws, FP8 blocks),
safetensors_writer.py (streaming shard writer), tokenizer.py (BPE + chat template),
checkpoint.py (synthesize: config, tokenizer, shards, index, atomic rename).
"""

from mlac.synth.checkpoint import DEFAULT_MAX_SHARD_BYTES, synthesize, weight_bytes
from mlac.synth.presets import PRESETS

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "PRESETS", "synthesize", "weight_bytes"]
