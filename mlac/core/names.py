"""The one naming table between Hugging Face DeepSeek checkpoints and mlac, and the tensors a
config implies.

`LAYER_NAMES` / `EXPERT_NAMES` / `GLOBAL_NAMES` / `MTP_NAMES` map HF names to mlac names (before
fusion); `expected_layer` / `expected_globals` / `expected_mtp` give every HF tensor a ModelConfig
implies, with its shape and whether a DeepSeek FP8 release stores it as e4m3. The reader checks a
checkpoint against them, synth draws a checkpoint from them, and the trained model is exported
through them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlac.core.config import ModelConfig

# HF name suffix inside `model.layers.{i}.` -> mlac name inside `layers.{i}.` (before fusion)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn.wq",
    "self_attn.q_a_proj.weight": "attn.wq_a",
    "self_attn.q_a_layernorm.weight": "attn.q_norm",
    "self_attn.q_b_proj.weight": "attn.wq_b",
    "self_attn.kv_a_proj_with_mqa.weight": "attn.w_kv_a",
    "self_attn.kv_a_layernorm.weight": "attn.kv_norm",
    "self_attn.kv_b_proj.weight": "attn.wkv_b",
    "self_attn.o_proj.weight": "attn.wo",
    "mlp.gate_proj.weight": "mlp.w1",
    "mlp.up_proj.weight": "mlp.w3",
    "mlp.down_proj.weight": "mlp.w2",
    "mlp.gate.weight": "moe.gate",
    "mlp.gate.e_score_correction_bias": "moe.gate_bias",
    "mlp.shared_experts.gate_proj.weight": "moe.shared.w1",
    "mlp.shared_experts.up_proj.weight": "moe.shared.w3",
    "mlp.shared_experts.down_proj.weight": "moe.shared.w2",
}
EXPERT_NAMES = {"gate_proj.weight": "w1", "up_proj.weight": "w3", "down_proj.weight": "w2"}
GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "head"}
# HF name suffix inside an MTP layer `model.layers.{N+k}.` -> mlac name (before the rename to `mtp.{k}.`)
MTP_NAMES = {
    "enorm.weight": "enorm",
    "hnorm.weight": "hnorm",
    "eh_proj.weight": "eh_proj",
    "shared_head.norm.weight": "norm",
}
MTP_COPIES = {"embed_tokens.weight": "embed", "shared_head.head.weight": "head"}  # V3: the main ones' copies
NOT_QUANTIZED = {"mlp.gate.weight"}  # 2-D but never FP8 in DeepSeek releases: the router


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]
    fp8: bool  # stored as e4m3 with a weight_scale_inv sibling in an FP8 checkpoint


def expected_layer(cfg: ModelConfig, i: int) -> dict[str, Expected]:
    """HF suffix -> expected shape for decoder layer i (before the FP8 scale companions)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d),
        "self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "self_attn.o_proj.weight": (d, h * cfg.v_head_dim),
    }
    if cfg.q_lora_rank is None:
        shapes["self_attn.q_proj.weight"] = (h * cfg.qk_head_dim, d)
    else:
        shapes["self_attn.q_a_proj.weight"] = (cfg.q_lora_rank, d)
        shapes["self_attn.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes["self_attn.q_b_proj.weight"] = (h * cfg.qk_head_dim, cfg.q_lora_rank)
    if cfg.is_moe_layer(i):
        e, im = cfg.n_routed_experts, cfg.moe_intermediate_size
        shapes["mlp.gate.weight"] = (e, d)
        if cfg.topk_method == "noaux_tc":
            shapes["mlp.gate.e_score_correction_bias"] = (e,)
        for x in range(e):
            shapes |= _mlp(f"mlp.experts.{x}.", im, d)
        if cfg.n_shared_experts:
            shapes |= _mlp("mlp.shared_experts.", im * cfg.n_shared_experts, d)
    else:
        shapes |= _mlp("mlp.", cfg.intermediate_size, d)
    return {k: Expected(s, len(s) == 2 and k not in NOT_QUANTIZED) for k, s in shapes.items()}


def _mlp(prefix: str, inter: int, d: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}gate_proj.weight": (inter, d),
        f"{prefix}up_proj.weight": (inter, d),
        f"{prefix}down_proj.weight": (d, inter),
    }


def expected_globals(cfg: ModelConfig) -> dict[str, Expected]:
    v, d = cfg.vocab_size, cfg.hidden_size
    return {
        "model.embed_tokens.weight": Expected((v, d), False),
        "model.norm.weight": Expected((d,), False),
        "lm_head.weight": Expected((v, d), False),
    }


def expected_mtp(cfg: ModelConfig, n: int) -> dict[str, Expected]:
    """HF suffix -> expected shape for the MTP layer stored at index n: a decoder layer plus its
    norms, eh_proj [D, 2D] and its copies of the embedding and head."""
    d, v = cfg.hidden_size, cfg.vocab_size
    extra = {
        "enorm.weight": Expected((d,), False),
        "hnorm.weight": Expected((d,), False),
        "eh_proj.weight": Expected((d, 2 * d), True),
        "shared_head.norm.weight": Expected((d,), False),
        "embed_tokens.weight": Expected((v, d), False),
        "shared_head.head.weight": Expected((v, d), False),
    }
    return expected_layer(cfg, n) | extra


def mlac_layer_name(suffix: str) -> str:
    if suffix in LAYER_NAMES:
        return LAYER_NAMES[suffix]
    m = re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+_proj\.weight)", suffix)
    assert m, suffix
    return f"moe.experts.{m.group(1)}.{EXPERT_NAMES[m.group(2)]}"
