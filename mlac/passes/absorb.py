"""absorb: MLA weight absorption, kv_b split into per-head w_kc and w_vc.

    attn.wkv_b [H·(nope+v), kv]  ->  attn.w_kc [H, nope, kv]   (k_nope[h] = w_kc[h] @ latent)
                                     attn.w_vc [H, kv, v]      (v[h] = latent @ w_vc[h])

Decode then runs attention over the latent cache directly: q_nope is projected into the
latent space through w_kc, and the attention output leaves it through w_vc. An FP8 kv_b is
dequantized first; w_kc and w_vc stay unquantized (bf16 for an FP8 source).
"""

from __future__ import annotations

import torch

from mlac.core.fp8 import dequantize_lazy
from mlac.core.lazy import LazyTensor
from mlac.passes import PassContext

NAME = "absorb"


def params(ctx: PassContext) -> dict:
    return {"w_kc": "[H, nope, kv_lora]", "w_vc": "[H, kv_lora, v]"}


def run(tensors: dict[str, LazyTensor], ctx: PassContext) -> dict[str, LazyTensor]:
    if ctx.layer is None:
        return tensors
    cfg, pre = ctx.config, f"layers.{ctx.layer}.attn."
    t = dict(tensors)
    kv_b, scale = t.pop(pre + "wkv_b"), t.pop(pre + "wkv_b.scale", None)
    if scale is not None:
        kv_b = dequantize_lazy(kv_b, scale)
    h, nope, v, kv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    dtype = kv_b.dtype

    def per_head() -> torch.Tensor:  # [H, nope+v, kv]
        return kv_b.load().view(h, nope + v, kv)

    t[pre + "w_kc"] = LazyTensor((h, nope, kv), dtype, lambda: per_head()[:, :nope].contiguous())
    t[pre + "w_vc"] = LazyTensor((h, kv, v), dtype, lambda: per_head()[:, nope:].transpose(1, 2).contiguous())
    return t
