"""The DeepSeek V2/V3 model over mlac tensor names: MLA attention, dense MLP, MoE, decoder, model.

Shapes: T packed new tokens of a step, B sequences, S cached tokens of a sequence, H heads,
D hidden, C = kv_lora (latent), R = rope dims, `nope`/`v` per-head dims.

Attention reads and writes the paged latent cache (kv_cache.py): each token caches
`kv_norm(latent) ‖ rope(k_rope)` [C + R]. Prefill/extend decompresses K and V per head from the
latents (MHA form); decode stays in latent space (absorbed form: MQA over the latents).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlac.config import ModelConfig
from mlac.kernels.extend_attention import extend_attention
from mlac.kernels.mla_decode import mla_decode
from mlac.kernels.moe import fused_moe, route_ref
from mlac.runtime.kv_cache import ForwardBatch, PagedKVCache
from mlac.runtime.layers import Linear, RMSNorm, RotaryEmbedding, Weights, apply_rope, take_weight

LATENT_NORM_EPS = 1e-6  # q_norm / kv_norm: transformers' q_a_layernorm / kv_a_layernorm default


class MLAttention(nn.Module):
    """Multi-head latent attention of one layer."""

    def __init__(self, config: ModelConfig, weights: Weights, layer: int):
        super().__init__()
        p = f"layers.{layer}.attn"
        self.layer = layer
        self.n_heads = config.num_attention_heads
        self.nope, self.rope, self.v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora = config.kv_lora_rank
        self.q_lora = config.q_lora_rank
        self.scale = config.softmax_scale
        if self.q_lora is not None:
            self.w_qkv_a = Linear(weights, f"{p}.w_qkv_a")  # rows: q_a ‖ kv_a ‖ k_rope
            self.q_norm = RMSNorm(weights, f"{p}.q_norm", LATENT_NORM_EPS)
            self.wq_b = Linear(weights, f"{p}.wq_b")
        else:
            self.wq = Linear(weights, f"{p}.wq")
            self.w_kv_a = Linear(weights, f"{p}.w_kv_a")  # rows: kv_a ‖ k_rope
        self.kv_norm = RMSNorm(weights, f"{p}.kv_norm", LATENT_NORM_EPS)
        self.register_buffer("w_kc", weights.take(f"{p}.w_kc"), persistent=False)  # [H, nope, C]
        self.register_buffer("w_vc", weights.take(f"{p}.w_vc"), persistent=False)  # [H, C, v]
        self.wo = Linear(weights, f"{p}.wo")

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q_nope [T, H, nope], roped q_rope [T, H, R], cache entry [T, C + R]."""
        if self.q_lora is not None:
            q_a, kv_a, k_rope = self.w_qkv_a(x).split([self.q_lora, self.kv_lora, self.rope], dim=-1)
            q = self.wq_b(self.q_norm(q_a))
        else:
            q = self.wq(x)
            kv_a, k_rope = self.w_kv_a(x).split([self.kv_lora, self.rope], dim=-1)
        q_nope, q_rope = q.view(x.shape[0], self.n_heads, -1).split([self.nope, self.rope], dim=-1)
        latent = torch.cat([self.kv_norm(kv_a), apply_rope(k_rope, cos, sin)], dim=-1)
        return q_nope, apply_rope(q_rope, cos, sin), latent

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:  # [T, D] -> [T, D]
        q_nope, q_rope, latent = self.project(x, cos, sin)
        cache.write(self.layer, batch.slots, latent)
        if batch.is_decode:
            o = self.decode(q_nope, q_rope, batch, cache)
        else:
            o = self.extend(q_nope, q_rope, batch, cache)
        return self.wo(o.flatten(1).to(x.dtype))

    def decode(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache
    ) -> torch.Tensor:
        """Absorbed form, one new token per sequence: MQA over the paged latents -> [B, H, v]."""
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, self.w_kc).contiguous()  # [B, H, C]
        kv = cache.layers[self.layer]
        o_lat = mla_decode(q_lat, q_rope, kv, batch.block_tables, batch.seq_lens, self.scale)  # [B, H, C]
        return torch.einsum("bhc,hcv->bhv", o_lat, self.w_vc)

    def extend(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache
    ) -> torch.Tensor:
        """MHA form (prefill, or extend after a cached prefix), causal -> [T, H, v].

        K and V are decompressed from every sequence's cached latents (prefix and new tokens)."""
        kv = cache.read(self.layer, batch.kv_slots)  # [S, C + R], all sequences packed
        latent, k_rope = kv.split([self.kv_lora, self.rope], dim=-1)
        k_nope = torch.einsum("sc,hdc->shd", latent, self.w_kc)  # [S, H, nope]
        v = torch.einsum("sc,hcv->shv", latent, self.w_vc).contiguous()  # [S, H, v]
        k = torch.cat([k_nope, k_rope[:, None, :].expand(-1, self.n_heads, -1)], dim=-1)  # [S, H, nope + R]
        q = torch.cat([q_nope, q_rope], dim=-1)  # [T, H, nope + R]
        return extend_attention(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_kv, self.scale)


class MLP(nn.Module):
    """SiLU-gated MLP: w2(silu(gate) * up), gate/up = halves of w13(x). Dense layers, shared experts."""

    def __init__(self, weights: Weights, prefix: str):
        super().__init__()
        self.w13 = Linear(weights, f"{prefix}.w13")  # [2I, D]: gate rows, then up rows
        self.w2 = Linear(weights, f"{prefix}.w2")  # [D, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class MoE(nn.Module):
    """Routed experts (float32 router, `route_ref`, `fused_moe`) plus the shared experts."""

    def __init__(self, config: ModelConfig, weights: Weights, layer: int):
        super().__init__()
        p = f"layers.{layer}.moe"
        self.config = config
        self.register_buffer("gate", weights.take(f"{p}.gate"), persistent=False)  # [E, D]
        bias = weights.take(f"{p}.gate_bias") if config.topk_method == "noaux_tc" else None
        self.register_buffer("gate_bias", bias, persistent=False)  # [E] float32
        w13, w13_scale = take_weight(weights, f"{p}.w13")  # [E, 2I, D]
        w2, w2_scale = take_weight(weights, f"{p}.w2")  # [E, D, I]
        for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
            self.register_buffer(name, t, persistent=False)
        self.shared = MLP(weights, f"{p}.shared") if config.n_shared_experts > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        c = self.config
        logits = x.float() @ self.gate.float().T  # [T, E]
        weights, ids = route_ref(
            logits,
            top_k=c.num_experts_per_tok,
            method=c.topk_method,
            scoring=c.scoring_func,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
            bias=self.gate_bias,
        )
        y = fused_moe(x, self.w13, self.w2, weights, ids, self.w13_scale, self.w2_scale)
        if self.shared is not None:
            y = y + self.shared(x)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: Weights, layer: int):
        super().__init__()
        p = f"layers.{layer}"
        self.attn_norm = RMSNorm(weights, f"{p}.attn_norm", config.rms_norm_eps)
        self.attn = MLAttention(config, weights, layer)
        self.ffn_norm = RMSNorm(weights, f"{p}.ffn_norm", config.rms_norm_eps)
        self.ffn = MoE(config, weights, layer) if config.is_moe_layer(layer) else MLP(weights, f"{p}.mlp")

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, batch, cache)
        return x + self.ffn(self.ffn_norm(x))


class DeepseekModel(nn.Module):
    """Embedding, decoder layers, final norm, LM head. Built from (and consumes) every tensor of a rank."""

    def __init__(self, config: ModelConfig, weights: Weights):
        super().__init__()
        self.config = config
        self.register_buffer("embed", weights.take("embed"), persistent=False)  # [V, D]
        self.layers = nn.ModuleList(DecoderLayer(config, weights, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(weights, "norm", config.rms_norm_eps)
        self.head = Linear(weights, "head")  # [V, D]
        self.rope = RotaryEmbedding(config, device=self.embed.device)
        weights.finish()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """token_ids [T] (packed as `batch` says) -> final-normed hidden states [T, D]."""
        cos, sin = self.rope.cos_sin(batch.positions)  # [T, R] float32
        x = F.embedding(token_ids, self.embed)
        for layer in self.layers:
            x = layer(x, cos, sin, batch, cache)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] float32."""
        return self.head(hidden).float()
