"""ModelConfig: real DeepSeek configs parse with the right math; unsupported values are refused."""

from __future__ import annotations

import json
import math

import pytest
from _paths import CONFIGS

from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError

CONFIGS = CONFIGS


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_real_configs_parse():
    lite, v2, v3, r1 = (
        ModelConfig.from_hf(load(n))
        for n in ("DeepSeek-V2-Lite", "DeepSeek-V2", "DeepSeek-V3", "DeepSeek-R1")
    )
    assert lite.q_lora_rank is None and lite.topk_method == "greedy" and lite.n_group == 1
    assert v2.topk_method == "group_limited_greedy" and (v2.n_group, v2.topk_group) == (8, 3)
    assert v2.routed_scaling_factor == 16.0 and v2.scoring_func == "softmax"
    for c in (v3, r1):
        assert c.topk_method == "noaux_tc" and c.scoring_func == "sigmoid" and c.norm_topk_prob
        assert c.routed_scaling_factor == 2.5 and c.num_nextn_predict_layers == 1
        assert c.quantization is not None and c.quantization.weight_block_size == (128, 128)
        assert not c.is_moe_layer(2) and c.is_moe_layer(3)
    assert lite.kv_latent_dim == 576 and v3.qk_head_dim == 192


def test_yarn_softmax_scale():
    """softmax scale = qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2 (DeepSeek's YaRN)."""
    v2 = ModelConfig.from_hf(load("DeepSeek-V2"))
    m = 0.1 * 0.707 * math.log(40) + 1
    assert v2.softmax_scale == pytest.approx(192**-0.5 * m * m)
    no_yarn = ModelConfig.from_hf({**load("DeepSeek-V2"), "rope_scaling": None})
    assert no_yarn.softmax_scale == pytest.approx(192**-0.5)


def test_moe_layer_freq():
    cfg = ModelConfig.from_hf({**load("DeepSeek-V2-Lite"), "moe_layer_freq": 2, "first_k_dense_replace": 1})
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"model_type": "llama"}, "model_type='llama'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings=True"),
        ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "rope_scaling.type='linear'"),
        ({"topk_method": "random"}, "topk_method"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"n_group": 7}, "n_group=7"),
        ({"topk_group": 9}, "topk_group=9"),
        ({"num_key_value_heads": 8}, "num_key_value_heads=8"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method='awq'"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt='e5m2'"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
            "weight_block_size=[64, 64]",
        ),
        ({"vocab_size": "many"}, "vocab_size"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_values_name_the_field(changes, needle):
    with pytest.raises(MlacError, match="unsupported|field") as e:
        ModelConfig.from_hf({**load("DeepSeek-V3"), **changes})
    assert needle in str(e.value)
    assert "\n" not in str(e.value)
