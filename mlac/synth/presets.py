"""Preset Hugging Face `config.json` dicts for synthetic DeepSeek checkpoints.

The tiny presets keep every structural feature of their real counterpart (MLA with and without
q-LoRA, dense-then-MoE layers, group-limited routing, noaux_tc with a correction bias, YaRN, the
FP8 block format, an MTP layer) at sizes that run on a CPU in milliseconds. `v2-lite` is the real
DeepSeek-V2-Lite config: real shapes, ~15.7B parameters, ~31 GB of bf16.
"""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, Any] = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "moe_layer_freq": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

# hidden 256 / 4 heads / intermediate 512: whole 128x128 FP8 blocks, forward of 64 tokens in ms.
_TINY: dict[str, Any] = {
    **_COMMON,
    "vocab_size": 1024,  # = the tokenizer: every id decodes to text
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "first_k_dense_replace": 1,
}

# original 128 x factor 32 = 4096 positions; at 128 original positions YaRN bends the low
# frequencies of a 16- or 32-wide rope dim (with 4096 it would leave tiny dims untouched).
_TINY_YARN: dict[str, Any] = {
    "type": "yarn",
    "factor": 32,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
}

TINY_V2_LITE: dict[str, Any] = {
    **_TINY,
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "q_lora_rank": None,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "rope_scaling": None,
}

TINY_V2: dict[str, Any] = {
    **_TINY,
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 2,
    "num_experts_per_tok": 4,
    "topk_method": "group_limited_greedy",
    "scoring_func": "softmax",
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": False,
    "routed_scaling_factor": 4.0,
    "rope_scaling": {**_TINY_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
}

TINY_V3: dict[str, Any] = {
    **_TINY,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "q_lora_rank": 128,  # a multiple of 128: the fused q_a+kv_a FP8 blocks stay aligned
    "kv_lora_rank": 128,  # kv_a rows 128+32 = 160: a partial FP8 block row
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1,
    "rope_scaling": {**_TINY_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}

# deepseek-ai/DeepSeek-V2-Lite config.json, less `auto_map` (no remote code is written).
V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 102400,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-v2-lite": TINY_V2_LITE,
    "tiny-v2": TINY_V2,
    "tiny-v3": TINY_V3,
    "v2-lite": V2_LITE,
}
