"""Fused MoE: routing (greedy softmax, group_limited_greedy, noaux_tc) and the grouped expert GEMMs.

Experts are stacked: w13 [E, 2I, D] (gate rows, then up rows), w2 [E, D, I], bf16/fp32 or e4m3
with block scales [E, ceil(rows/128), ceil(cols/128)]. `fused_moe` dispatches on device.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from mlac.kernels.fp8_gemm import dequantize_blocks, fp8_linear_ref

TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]


def route_ref(
    logits: torch.Tensor,
    top_k: int,
    method: TopkMethod,
    scoring: Literal["softmax", "sigmoid"],
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int64).

    - greedy: top-k of the scores.
    - group_limited_greedy: keep the `topk_group` groups with the largest max score, then top-k.
    - noaux_tc: choose with scores + bias (`e_score_correction_bias`), groups ranked by the sum of
      their top-2 biased scores; the weights come from the unbiased scores.
    norm_topk_prob renormalizes the chosen weights. routed_scaling_factor then multiplies them,
    except in the DeepSeek-V2 methods where it replaces the normalization (as V2's gate does).
    """
    logits = logits.to(torch.float32)
    t, e = logits.shape
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.to(torch.float32)
    if method != "greedy" and n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        if method == "noaux_tc":
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_score = grouped.amax(dim=-1)
        keep = group_score.topk(topk_group, dim=-1).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_score).scatter_(1, keep, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
        fill = float("-inf") if method == "noaux_tc" else 0.0
        choice = choice.masked_fill(~expert_mask, fill)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if method == "noaux_tc":
        if norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * routed_scaling_factor
    elif norm_topk_prob and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * routed_scaling_factor
    return weights, ids


def _expert_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return F.linear(x, w.to(x.dtype))
    return fp8_linear_ref(x, w, scale)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, D] -> sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t]), [T, D] in x's dtype.

    expert(x) = w2 @ (silu(gate) * up), gate/up = halves of w13 @ x. Expert ids outside
    [0, E) are skipped (they belong to another rank under expert parallelism).
    """
    t, d = x.shape
    e, two_i, _ = w13.shape
    out = torch.zeros(t, d, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        if not 0 <= expert < e:
            continue
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        h = _expert_linear(x[token], w13[expert], None if w13_scale is None else w13_scale[expert])
        gate, up = h.split(two_i // 2, dim=-1)
        y = _expert_linear(F.silu(gate) * up, w2[expert], None if w2_scale is None else w2_scale[expert])
        out.index_add_(0, token, y.to(torch.float32) * topk_weights[token, slot, None].to(torch.float32))
    return out.to(x.dtype)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatching entry point (Triton on CUDA, reference on CPU); contract as fused_moe_ref."""
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)


__all__ = ["route_ref", "fused_moe_ref", "fused_moe", "dequantize_blocks"]
