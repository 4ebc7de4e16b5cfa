"""Write trained DeepSeek-V3 weights as a standard Hugging Face checkpoint (bf16 or FP8).

Input: the tensors under transformers' names (its DeepseekV3ForCausalLM state dict, with routed
experts stacked as `mlp.experts.gate_up_proj` [E, 2I, D] and `mlp.experts.down_proj` [E, D, I]),
plus the MTP layer's tensors already named `model.layers.{N}.*` (N = num_hidden_layers).
Output: the per-expert names of the official releases (`mlp.experts.{j}.gate_proj.weight`...),
the MTP layer with its copies of the embedding and head (`embed_tokens`, `shared_head.head`) as V3
stores them, in one `model.safetensors`. With fp8, every weight that the reader's table marks as
FP8 (and the MTP `eh_proj`) is stored e4m3 with a float32 `weight_scale_inv` per 128x128 block,
by `mlac.core.fp8.quantize_blocks`, and config.json gets DeepSeek's `quantization_config`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mlac.core.config import ModelConfig
from mlac.core.fp8 import quantize_blocks
from mlac.core.names import expected_layer

QUANTIZATION_CONFIG: dict[str, Any] = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def unstack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked experts -> one gate/up/down weight per expert; other names kept."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _STACKED.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        for j, w in enumerate(t):  # w: [2I, D] (gate rows, then up rows) or [D, I]
            pre = f"{m.group(1)}.{j}."
            if m.group(2) == "down_proj":
                out[pre + "down_proj.weight"] = w
            else:
                gate, up = w.chunk(2)
                out[pre + "gate_proj.weight"], out[pre + "up_proj.weight"] = gate, up
    return out


def add_mtp_copies(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Add the MTP layers' own copies of the embedding and LM head, as V3 releases carry them."""
    for k in range(cfg.num_nextn_predict_layers):
        pre = f"model.layers.{cfg.num_hidden_layers + k}."
        tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"]


def fp8_names(cfg: ModelConfig) -> set[str]:
    """HF names stored in FP8: the reader's FP8 table for every layer and MTP block, and eh_proj."""
    names: set[str] = set()
    for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        pre = f"model.layers.{i}."
        names |= {pre + suffix for suffix, exp in expected_layer(cfg, i).items() if exp.fp8}
        if i >= cfg.num_hidden_layers:
            names.add(pre + "eh_proj.weight")
    return names


def encode(tensors: dict[str, torch.Tensor], cfg: ModelConfig, fp8: bool) -> dict[str, torch.Tensor]:
    """Stored tensors: bf16 (routing bias float32), or FP8 + `weight_scale_inv` where fp8 applies."""
    quantized = fp8_names(cfg) if fp8 else set()
    out: dict[str, torch.Tensor] = {}
    for name, t in sorted(tensors.items()):
        t = t.detach().float().cpu()
        if name in quantized:
            out[name], out[name.removesuffix(".weight") + ".weight_scale_inv"] = quantize_blocks(t)
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out


def write_checkpoint(out: Path, raw: dict[str, Any], tensors: dict[str, torch.Tensor], fp8: bool) -> None:
    """Write config.json and model.safetensors into the existing directory `out`.

    raw: the config.json dict (bf16); `tensors`: transformers' names plus the MTP layer (see
    the module docstring). The tensor set is checked by mlac's reader when it is compiled.
    """
    raw = {**raw, "torch_dtype": "bfloat16"}
    if fp8:
        raw["quantization_config"] = dict(QUANTIZATION_CONFIG)
    cfg = ModelConfig.from_hf(raw, source=str(out / "config.json"))
    hf = unstack_experts(tensors)
    add_mtp_copies(hf, cfg)
    save_file(encode(hf, cfg, fp8), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file leaves 0600
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
