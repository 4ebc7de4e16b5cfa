"""rope: fold DeepSeek's interleaved rope layout into the weights.

HF checkpoints rotate rope dims in interleaved pairs (x0, x1), (x2, x3), ... . Permuting the
rope rows of the q projection (the last `rope` rows of every head) and of kv_a (its last `rope`
rows) to (x0, x2, ..., x1, x3, ...) lets the runtime apply plain rotate-half rope. q and k are
permuted alike, so q·k is unchanged.

An FP8 weight keeps its blocks when every permuted segment lies inside one 128-row block (the
scale is constant over a block's rows); otherwise it is dequantized here and the fp8 pass
requantizes it.
"""

from __future__ import annotations

import torch

from mlac.core.fp8 import BLOCK, dequantize_lazy
from mlac.core.lazy import LazyTensor
from mlac.passes import PassContext

NAME = "rope"


def params(ctx: PassContext) -> dict:
    return {"layout": "rotate_half", "rope_dim": ctx.config.qk_rope_head_dim}


def deinterleave(rope: int) -> torch.Tensor:
    """[0, 2, 4, ..., rope-2, 1, 3, ..., rope-1]."""
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])


def row_permutation(rows: int, starts: list[int], rope: int) -> torch.Tensor:
    idx = torch.arange(rows)
    perm = deinterleave(rope)
    for s in starts:
        idx[s : s + rope] = s + perm
    return idx


def run(tensors: dict[str, LazyTensor], ctx: PassContext) -> dict[str, LazyTensor]:
    if ctx.layer is None:
        return tensors
    cfg, pre = ctx.config, f"layers.{ctx.layer}.attn."
    rope, qk = cfg.qk_rope_head_dim, cfg.qk_head_dim
    q_name = pre + ("wq" if cfg.q_lora_rank is None else "wq_b")
    q_starts = [h * qk + cfg.qk_nope_head_dim for h in range(cfg.num_attention_heads)]
    out = dict(tensors)
    _permute_rows(out, q_name, q_starts, rope)
    _permute_rows(out, pre + "w_kv_a", [cfg.kv_lora_rank], rope)
    return out


def _permute_rows(tensors: dict[str, LazyTensor], name: str, starts: list[int], rope: int) -> None:
    w = tensors[name]
    idx = row_permutation(w.shape[0], starts, rope)
    scale = tensors.get(name + ".scale")
    if scale is not None and any(s // BLOCK != (s + rope - 1) // BLOCK for s in starts):
        # a segment straddles two blocks: permuting would mix scales, so leave FP8 here
        del tensors[name + ".scale"]
        w = dequantize_lazy(w, scale)
    tensors[name] = w.map(lambda t: t[idx])
