"""ModelOptions.fused_mla_out in the model: with an FP8 `wo`, the decode's attention output reaches
it as an Fp8Act made by the v-absorb head_bmm (no act_quant of its own), and the tokens are those of
the separate launches (the option off). On CPU both run the references: the same bits by
construction of `quantize_act_ref`; kernel-level bit equality is in tests/kernels/test_mla_out_fused.py.

The tiny presets have v_head_dim 32 (a 128-channel group would span 4 heads): this model is
tiny-v2-lite with v_head_dim 128, where each head's output is one group.
"""

from __future__ import annotations

import json

import pytest
import torch

import mlac.runtime.model.layers as layers
from mlac.compiler.pipeline import compile_checkpoint
from mlac.core.artifact import CompileOptions
from mlac.kernels.fp8_quant import Fp8Act
from mlac.runtime.engine.engine import Engine
from mlac.synth import synthesize
from mlac.synth.presets import PRESETS


@pytest.fixture(scope="module")
def fp8_v128(tmp_path_factory):
    """An FP8 artifact of tiny-v2-lite with v_head_dim 128."""
    root = tmp_path_factory.mktemp("v128")
    cfg = {**PRESETS["tiny-v2-lite"], "v_head_dim": 128}
    (root / "config.json").write_text(json.dumps(cfg))
    ckpt = synthesize(root / "ckpt", config_path=root / "config.json", seed=0)
    compile_checkpoint(ckpt, root / "art", CompileOptions(fp8=True))
    return root / "art"


def _run(path, monkeypatch, fused: bool) -> tuple[list[int], list[tuple[int, bool]]]:
    """(greedy tokens, (rows, reads an Fp8Act) of every `wo` call)."""
    engine = Engine.from_artifact(path, fused_mla_out=fused)
    wo = {id(layer.attn.wo.weight) for layer in engine.runner.model.layers}
    calls = []
    real = layers.fp8_linear

    def spy(x, w, *args, **kwargs):
        if id(w) in wo:
            calls.append((x.shape[0], isinstance(x, Fp8Act)))
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(layers, "fp8_linear", spy)
    ids = torch.randint(2, 200, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    tokens = engine.generate(ids, max_tokens=6, ignore_eos=True).token_ids
    monkeypatch.setattr(layers, "fp8_linear", real)
    return tokens, calls


def test_fp8_wo_reads_head_bmm_quantized_output(fp8_v128, monkeypatch):
    tokens_on, on = _run(fp8_v128, monkeypatch, fused=True)
    tokens_off, off = _run(fp8_v128, monkeypatch, fused=False)
    assert tokens_on == tokens_off and len(set(tokens_on)) > 1
    decode_on = [act for rows, act in on if rows == 1]
    assert decode_on and all(decode_on)  # every decode step's wo reads head_bmm's Fp8Act
    assert not any(act for rows, act in on if rows > 1)  # prefill: the extend output, a tensor
    assert off and not any(act for _, act in off)  # option off: wo quantizes its input itself
