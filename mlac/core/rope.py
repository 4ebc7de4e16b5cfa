"""Rope frequencies of a DeepSeek config: plain, or YaRN as transformers computes it. Shared by the
runtime's RotaryEmbedding and the ONNX export (which computes rope in the graph)."""

from __future__ import annotations

import math

import torch

from mlac.core.config import ModelConfig, yarn_mscale


def rope_parameters(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope/2] float32, attention_factor) over dim = qk_rope_head_dim.

    Plain rope without rope_scaling; with YaRN, exactly transformers' `_compute_yarn_parameters`
    (truncated correction range; the attention factor scales cos and sin).
    """
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    rs = config.rope_scaling
    if rs is None:
        return 1.0 / pos_freqs, 1.0
    factor = rs.factor
    if rs.mscale and rs.mscale_all_dim:
        attention_factor = yarn_mscale(factor, rs.mscale) / yarn_mscale(factor, rs.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor, 1.0)

    def correction_dim(rotations: float) -> float:
        orig = rs.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast or 32)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow or 1)), dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)
