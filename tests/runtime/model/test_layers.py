"""Layers: YaRN parameters and rope against transformers, RMSNorm, Linear's FP8 dispatch (the
Triton GEMM, or cuBLAS from the rows fp8_cublas.cublas_takes), Weights."""

from __future__ import annotations

import logging

import pytest
import torch
from _hf_convert import raw_config
from test_fp8_cublas import emulated, routed, small_weights  # noqa: F401  (fixtures)

from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.core.fp8 import FP8, FP8_MAX, dequantize_blocks, expand_block_scale
from mlac.core.rope import rope_parameters
from mlac.kernels.fp8_quant import Fp8Act
from mlac.kernels.gemm.fp8_gemm import fp8_linear_ref, quantize_act_ref
from mlac.runtime.model import layers
from mlac.runtime.model.layers import Linear, RMSNorm, RotaryEmbedding, Weights, apply_rope

YARN_CASES = {
    "v3-like": dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                    mscale=1.0, mscale_all_dim=1.0),
    "v2-like": dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                    mscale=0.707, mscale_all_dim=0.707),
    "ratio": dict(factor=8.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.5),
    "mscale-only": dict(factor=4.0, original_max_position_embeddings=64, mscale=0.707),
    "narrow-ramp": dict(factor=16.0, original_max_position_embeddings=512, beta_fast=8, beta_slow=2),
}  # fmt: skip


def hf_config(rope_scaling: dict | None, rope_dim: int = 64):
    from transformers import DeepseekV3Config

    raw = raw_config(
        "v3", qk_rope_head_dim=rope_dim, max_position_embeddings=163840, rope_scaling=rope_scaling
    )
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "torch_dtype")}
    return DeepseekV3Config(**kwargs), ModelConfig.from_hf(raw)


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_parameters_match_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf, cfg = hf_config({"type": "yarn", **YARN_CASES[case]})
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    got_freq, got_factor = rope_parameters(cfg)
    assert torch.equal(got_freq, want_freq.float())
    assert got_factor == pytest.approx(want_factor, rel=1e-12)


def test_plain_rope_parameters():
    _, cfg = hf_config(None, rope_dim=8)
    inv_freq, factor = rope_parameters(cfg)
    assert factor == 1.0
    assert torch.allclose(inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8))


def test_rotate_half_on_deinterleaved_dims_equals_transformers_interleaved_rope():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
    )

    hf, cfg = hf_config({"type": "yarn", **YARN_CASES["ratio"]}, rope_dim=16)
    positions = torch.tensor([0, 1, 5, 31, 100, 4000])
    x = torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(0))  # [T, H, R], interleaved pairs
    cos, sin = DeepseekV3RotaryEmbedding(hf)(x, positions[None])
    want, _ = apply_rotary_pos_emb_interleave(
        x.transpose(0, 1)[None], x[:, :1].transpose(0, 1)[None], cos, sin
    )
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])
    got = apply_rope(x[..., perm], *RotaryEmbedding(cfg).cos_sin(positions))
    assert torch.allclose(got, want[0].transpose(0, 1), atol=1e-6)


def test_rms_norm_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    w = torch.randn(32)
    ref = DeepseekV3RMSNorm(32, eps=1e-5)
    ref.weight.data.copy_(w)
    x = torch.randn(5, 32).to(torch.bfloat16)
    got = RMSNorm(Weights({"n": w.to(torch.bfloat16)}), "n", eps=1e-5)(x)
    want = ref.to(torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Test helper: [N, K] -> e4m3 [N, K] and float32 128x128 block scales."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.nn.functional.pad(w, (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128)
    scale = (padded.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [nb, kb]
    q = (w / expand_block_scale(scale, n, k)).to(FP8)
    return q, scale


def test_linear_dispatches_on_the_stored_format():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 192, generator=g) * 0.05
    x = torch.randn(7, 192, generator=g)
    q, scale = quantize_blocks(w)
    fp8 = Linear(Weights({"w": q, "w.scale": scale}), "w")
    assert torch.equal(fp8(x), fp8_linear_ref(x, q, scale, out_dtype=x.dtype))
    dense = Linear(Weights({"w": w}), "w")
    assert torch.equal(dense(x), x @ w.T)
    rel = (fp8(x) - x @ dequantize_blocks(q, scale).T).norm() / (x @ w.T).norm()
    assert rel < 0.05  # W8A8 error, against the dequantized weight


def test_linear_refuses_inconsistent_fp8_tensors():
    q, scale = quantize_blocks(torch.randn(128, 128))
    with pytest.raises(MlacError, match="is FP8 but has no .scale"):
        Linear(Weights({"w": q}), "w")
    with pytest.raises(MlacError, match="has a .scale but is not FP8"):
        Linear(Weights({"w": torch.randn(128, 128), "w.scale": scale}), "w")


def test_weights_are_taken_exactly_once():
    w = Weights({"a": torch.zeros(1), "b": torch.zeros(1)}, source="x.safetensors")
    w.take("a")
    with pytest.raises(MlacError, match="'a' is missing"):
        w.take("a")
    with pytest.raises(MlacError, match="does not use: b"):
        w.finish()


# ---- the cuBLAS route of FP8 Linears (kernels/gemm/fp8_cublas.py) ----------------------------------


@pytest.fixture
def cublas_calls(emulated, routed) -> list[tuple[int, bool]]:  # noqa: F811
    """layers.cublas_fp8_linear spied (test_fp8_cublas.routed), torch._scaled_mm emulated on the CPU."""
    return routed


def fp8_linear_of(n: int, k: int) -> Linear:
    g = torch.Generator().manual_seed(n + k)
    return Linear(
        Weights(dict(zip(("w", "w.scale"), quantize_blocks(torch.randn(n, k, generator=g)), strict=True))),
        "w",
    )


@pytest.mark.parametrize("n, k", [(640, 512), (256, 512)])  # N >= K: from 32 rows; N < K: above 64
def test_fp8_linear_takes_cublas_where_the_rule_says(cublas_calls, n, k):
    lin = fp8_linear_of(n, k)
    lin.cublas = True
    first = 32 if n >= k else 65
    g = torch.Generator().manual_seed(1)
    for m in (1, 16, 31, 32, 64, 65, 257):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        y = lin(x)
        want = fp8_linear_ref(x, lin.weight, lin.scale, out_dtype=x.dtype)
        assert y.shape == (m, n) and (y - want).float().norm() <= 1e-2 * want.float().norm()
    assert cublas_calls == [(m, False) for m in (32, 64, 65, 257) if m >= first]
    cublas_calls.clear()
    x3 = torch.randn(3, 33, k, generator=g).to(torch.bfloat16)  # [B, T, K]: 99 rows
    act = Fp8Act(*quantize_act_ref(x3.view(99, k)), torch.bfloat16)
    assert lin(x3).shape == (3, 33, n) and lin(act).shape == (99, n)
    assert cublas_calls == [(99, False), (99, True)]
    lin.cublas = False  # the field, not the rows alone, opens the route
    lin(x3)
    assert cublas_calls == [(99, False), (99, True)]


def test_route_fp8_linears_sets_the_field_once_from_the_device(monkeypatch, caplog):
    fp8, dense = fp8_linear_of(640, 512), Linear(Weights({"w": torch.randn(64, 64)}), "w")
    model = torch.nn.ModuleList([fp8, dense])
    with caplog.at_level(logging.INFO, logger="mlac.runtime"):
        layers.route_fp8_linears(model, True, torch.device("cpu"), torch.bfloat16)
    assert not fp8.cublas and "cuBLAS block scaling: cpu device" in caplog.text
    monkeypatch.setattr(layers, "cublas_unavailable", lambda device, dtype: None)
    layers.route_fp8_linears(model, True, torch.device("cpu"), torch.bfloat16)
    assert fp8.cublas and not dense.cublas
    layers.route_fp8_linears(model, False, torch.device("cpu"), torch.bfloat16)  # ModelOptions.fp8_cublas
    assert not fp8.cublas
