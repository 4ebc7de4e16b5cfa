"""benchmarks/e2e/prefix_bound.py: its parameter counts are the synthetic checkpoint's, and its floors
move the way the bound says."""

from __future__ import annotations

import math

import pytest
from _paths import REPO, load_script

from mlac.core.config import ModelConfig
from mlac.synth.presets import PRESETS
from mlac.synth.weights import checkpoint_params

BENCH = REPO / "benchmarks" / "e2e"


@pytest.fixture(scope="module")
def pb():
    return load_script(BENCH / "prefix_bound.py")


@pytest.mark.parametrize("preset", ["v2-lite", "tiny-v3", "tiny-v2"])
def test_counts_match_the_checkpoint(pb, preset):
    """Every matrix of the checkpoint (norms, biases and MTP layers aside) is counted once: the
    embedding, the LM head, and the layers' parts."""
    cfg = ModelConfig.from_hf(dict(PRESETS[preset]))
    main = [p for p in checkpoint_params(cfg) if len(p.shape) == 2]
    main = [p for p in main if not any(f"layers.{i}." in p.name for i in range(cfg.num_hidden_layers, 99))]
    stored = sum(math.prod(p.shape) for p in main)
    parts = pb.layer_params(cfg)
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    experts = (cfg.n_routed_experts or 0) + cfg.n_shared_experts
    counted = (
        2 * cfg.vocab_size * cfg.hidden_size
        + cfg.num_hidden_layers * parts["attention"]
        + (cfg.num_hidden_layers - moe) * parts["dense_mlp"]
        + moe * (experts * parts["expert"] + parts["router"])
    )
    assert counted == stored


def test_v2_lite_bound(pb):
    """V2-Lite, 2,000 cached + 64 new tokens at DESIGN.md's H200 ceilings: every expert is read, the
    ratio is at most 2x, and serving time on both sides lowers it."""
    cfg = ModelConfig.from_hf(dict(PRESETS["v2-lite"]))
    b = pb.bound(cfg, 2000, 64, 4274.0, 680.0, 0.0, 2)
    assert b["experts_touched_per_layer"] > 63.5
    assert 30.5 < b["cached_step_gb"] < 31.4  # all weights but the embedding
    assert 1.9 < b["ratio_at_ceilings"] < 2.1
    assert pb.bound(cfg, 2000, 64, 4274.0, 680.0, 2.5, 2)["ratio_at_ceilings"] < b["ratio_at_ceilings"]
    # a shorter suffix reads fewer experts: a higher ratio
    assert pb.bound(cfg, 2000, 8, 4274.0, 680.0, 0.0, 2)["ratio_at_ceilings"] > b["ratio_at_ceilings"]
