"""The DeepSeek V2/V3 model over mlac tensor names: MLA attention, dense MLP, MoE, decoder, model.

Shapes: T packed new tokens of a step, B sequences, S cached tokens of a sequence, H heads,
D hidden, C = kv_lora (latent), R = rope dims, `nope`/`v` per-head dims.

Attention reads and writes the paged latent cache (kvcache/paged.py): each token caches
`kv_norm(latent) ‖ rope(k_rope)` [C + R]. Decode stays in latent space (absorbed form: MQA over the
latents); prefill/extend picks per step between that and decompressing K and V per head from the
latents (MHA form), whichever is cheaper (attention.py).

Parallel (parallel.py, slices as the shard pass cut them): each of the tp ranks runs
`n_local_heads = H / tp` heads and its slice of every MLP, and either a slice of every routed
expert (ep == 1) or E / tp whole experts (ep == tp). The latent projections, norms and router are
replicated, so every rank caches the same latents and routes identically. Per layer there is one
all-reduce after attention (`wo`) and one after the MLP or MoE; the embedding all-reduces and the
head all-gathers the logits. With tp == 1 these are identities.

DP attention (`dp_attention`, dp_attention.py): attention weights are whole on every rank, and
each rank runs every head for its own sequences only (no all-reduce after `wo`); a
TokenExchange gathers the ranks' tokens before each MLP / MoE and reduce-scatters its partial
sums back. A rank with no tokens in a step (`batch` None) skips attention and joins the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from mlac.core.config import ModelConfig
from mlac.kernels.activation import silu_mul, silu_mul_quant
from mlac.kernels.attention.mla_prep import mla_prep
from mlac.kernels.fp8_quant import Fp8Act
from mlac.kernels.moe.fused import fused_moe
from mlac.kernels.moe.router_gemv import gate_and_route
from mlac.kernels.moe.routing import RoutingSpec
from mlac.kernels.moe.shared import SharedExperts
from mlac.runtime.kvcache.batch import ForwardBatch
from mlac.runtime.kvcache.paged import PagedKVCache
from mlac.runtime.model.attention import (
    decode_absorbed,
    extend_absorbed,
    extend_mha,
    extend_shared,
    prefer_absorbed,
    prefer_shared,
)
from mlac.runtime.model.dp_attention import TokenExchange
from mlac.runtime.model.layers import (
    Linear,
    Reads,
    RMSNorm,
    RotaryEmbedding,
    Weights,
    reads_of,
    route_fp8_linears,
    take_weight,
)
from mlac.runtime.model.options import DEFAULTS, ModelOptions
from mlac.runtime.model.parallel import (
    SINGLE,
    ColumnParallelLinear,
    ParallelContext,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce,
)

LATENT_NORM_EPS = 1e-6  # q_norm / kv_norm: transformers' q_a_layernorm / kv_a_layernorm default


class MLAttention(nn.Module):
    """Multi-head latent attention of one layer: this rank's heads, `wo` all-reduced over the ranks;
    the forms it runs as `options` says."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        layer: int,
        ctx: ParallelContext = SINGLE,
        prefix: str = "",
        options: ModelOptions = DEFAULTS,
    ):
        super().__init__()
        p = f"{prefix or f'layers.{layer}'}.attn"
        self.layer = layer
        self.options = options
        self.n_local_heads = ctx.local(config.num_attention_heads, "num_attention_heads")
        self.nope, self.rope, self.v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora = config.kv_lora_rank
        self.q_lora = config.q_lora_rank
        self.scale = config.softmax_scale
        if self.q_lora is not None:
            self.w_qkv_a = Linear(weights, f"{p}.w_qkv_a")  # rows: q_a ‖ kv_a ‖ k_rope
            self.wq_b = ColumnParallelLinear(weights, f"{p}.wq_b", ctx)  # this rank's heads
            self.q_norm = RMSNorm(weights, f"{p}.q_norm", LATENT_NORM_EPS, reads_of(self.wq_b))
            self.reads = reads_of(self.w_qkv_a)  # x: what attn_norm writes
        else:
            self.wq = ColumnParallelLinear(weights, f"{p}.wq", ctx)  # this rank's heads
            self.w_kv_a = Linear(weights, f"{p}.w_kv_a")  # rows: kv_a ‖ k_rope
            self.reads = reads_of(self.wq, self.w_kv_a)  # one quantized x for both
        self.kv_norm = RMSNorm(weights, f"{p}.kv_norm", LATENT_NORM_EPS)
        self.register_buffer("w_kc", weights.take(f"{p}.w_kc"), persistent=False)  # [H_local, nope, C]
        self.register_buffer("w_vc", weights.take(f"{p}.w_vc"), persistent=False)  # [H_local, C, v]
        self.wo = RowParallelLinear(weights, f"{p}.wo", ctx)  # [D, H_local·v] -> all-reduce

    def project(
        self,
        x: torch.Tensor | Fp8Act,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> q_nope [T, H_local, nope], roped q_rope [T, H_local, R]; writes each token's
        cache entry kv_norm(latent) ‖ rope(k_rope) [C + R] (one fused launch: mla_prep)."""
        if self.q_lora is not None:
            qkv = self.w_qkv_a(x)  # [T, q_lora + C + R]
            q, kv = self.wq_b(self.q_norm(qkv[:, : self.q_lora])), qkv[:, self.q_lora :]
        else:
            q, kv = self.wq(x), self.w_kv_a(x)  # kv [T, C + R]: latent ‖ k_rope
        q = q.view(x.shape[0], self.n_local_heads, self.nope + self.rope)
        pool, scale = cache.layers[self.layer], cache.kv_scale(self.layer)
        mla_prep(q, kv, cos, sin, self.kv_norm.weight, self.kv_norm.eps, pool, batch.slots, scale)
        return q[..., : self.nope], q[..., self.nope :]

    def forward(
        self,
        x: torch.Tensor | Fp8Act,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:  # [T, D] (an Fp8Act when `reads` says so) -> [T, D]
        q_nope, q_rope = self.project(x, cos, sin, batch, cache)
        if batch.is_decode:
            o = self.decode(q_nope, q_rope, batch, cache)
        else:
            o = self.extend(q_nope, q_rope, batch, cache).flatten(1)
        if not isinstance(o, Fp8Act):
            o = o.to(x.dtype)
        return self.wo(o)  # row-parallel: all-reduced over the ranks

    def decode(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache
    ) -> torch.Tensor | Fp8Act:
        """Absorbed form, one new token per sequence: MQA over the paged latents -> [B, H_local·v],
        quantized for `wo` when it is FP8. An FP8 cache is read with its per-layer scale; the batch's
        `paged_mla` (FlashInfer's, when the runner planned one) runs in mla_decode's place."""
        kv, kv_scale = cache.layers[self.layer], cache.kv_scale(self.layer)  # [blocks, block_size, C + R]
        return decode_absorbed(
            q_nope, q_rope, kv, batch.block_tables, batch.seq_lens, self.scale, kv_scale,
            self.w_kc, self.w_vc, quant_out=self.wo.fp8, row_groups=batch.row_groups,
            fuse_out=self.options.fused_mla_out, paged=batch.paged_mla,
        )  # fmt: skip

    def extend(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache
    ) -> torch.Tensor:
        """Prefill, or extend after a cached prefix, causal -> [T, H_local, v]: over every sequence's
        cached latents (prefix and new tokens), in the cheaper exact form (attention.py); a
        prefix that several sequences share is attended to once for all of them (extend_shared)."""
        shared = batch.shared if self.options.shared_prefix else None
        if shared is not None and prefer_shared(shared.length, shared.sums, self.w_kc, self.w_vc, self.rope):
            kv = cache.read(self.layer, shared.kv_slots)  # [P + S', C + R]: the prefix, then each one's own
            return extend_shared(
                q_nope, q_rope, kv, self.w_kc, self.w_vc, shared, batch.cu_seqlens_q, max(batch.q_lens), self.scale,
            )  # fmt: skip
        kv = cache.read(self.layer, batch.kv_slots)  # [S, C + R], all sequences packed
        form = extend_absorbed if prefer_absorbed(batch.q_lens, batch.ctx_lens) else extend_mha
        return form(
            q_nope, q_rope, kv, self.w_kc, self.w_vc,
            batch.cu_seqlens_q, batch.cu_seqlens_kv, max(batch.q_lens), self.scale,
        )  # fmt: skip


class MLP(nn.Module):
    """SiLU-gated MLP: w2(silu(gate) * up), gate/up = halves of w13(x). Dense layers, shared experts.

    Column-parallel w13 (this rank's gate rows, then its up rows), row-parallel w2: all-reduced,
    or left a partial sum with `reduce=False` (shared experts, summed into the MoE's reduce).
    With an FP8 w2, silu·mul writes its output quantized (one launch, as w2 would quantize it)."""

    def __init__(self, weights: Weights, prefix: str, ctx: ParallelContext = SINGLE, reduce: bool = True):
        super().__init__()
        self.w13 = ColumnParallelLinear(weights, f"{prefix}.w13", ctx)  # [2I_local, D]
        self.w2 = RowParallelLinear(weights, f"{prefix}.w2", ctx, reduce)  # [D, I_local]
        self.reads = reads_of(self.w13)
        self.act = silu_mul_quant if self.w2.fp8 else silu_mul

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        return self.w2(self.act(self.w13(x)))  # w13(x) [T, 2I_local]: gate ‖ up

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, not reduced."""
        return self.w2.partial(self.act(self.w13(x)))


class MoE(nn.Module):
    """Routed experts (float32 router logits, `route`, `fused_moe`) plus the shared experts.

    The router is replicated: every rank routes every token identically. ep == 1: each rank holds
    a slice of every expert; ep == tp: rank r holds experts [r·E/tp, (r+1)·E/tp) whole, and the ids
    of the others fall outside [0, n_local_experts), which fused_moe skips. Either way each rank's
    output is a partial sum: routed and shared partials are added, then all-reduced once."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        layer: int,
        ctx: ParallelContext = SINGLE,
        prefix: str = "",
    ):
        super().__init__()
        p = f"{prefix or f'layers.{layer}'}.moe"
        self.config = config
        self.routing = RoutingSpec.from_config(config)
        self.ctx = ctx
        self.n_local_experts = config.n_routed_experts // ctx.ep
        self.first_expert = ctx.rank * self.n_local_experts if ctx.ep > 1 else 0
        self.register_buffer("gate", weights.take(f"{p}.gate"), persistent=False)  # [E, D]
        bias = weights.take(f"{p}.gate_bias") if config.topk_method == "noaux_tc" else None
        self.register_buffer("gate_bias", bias, persistent=False)  # [E] float32
        w13, w13_scale = take_weight(weights, f"{p}.w13")  # [E_local, 2I_local, D]
        w2, w2_scale = take_weight(weights, f"{p}.w2")  # [E_local, D, I_local]
        for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
            self.register_buffer(name, t, persistent=False)
        self.shared = MLP(weights, f"{p}.shared", ctx, reduce=False) if config.n_shared_experts > 0 else None
        # FP8 experts: x quantized once (by ffn_norm) for GEMM1 and the shared w13; the router reads x
        self.reads = Reads.X if w13_scale is None else Reads.FP8_AND_X

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:  # [T, D] -> [T, D]
        return all_reduce(self.partial(x), self.ctx)  # routed + shared partials, reduced once

    def partial(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:  # [T, D] -> [T, D], this rank's partial sum
        """x [T, D], or its Fp8Act carrying x (Reads.FP8_AND_X)."""
        x, x_act = (x.x, x) if isinstance(x, Fp8Act) else (x, None)
        # Router logits [T, E] in float32 (the gate is float32: loader.ROUTER), then routing: one
        # launch at decode up to 4 tokens (router_gemv.router_plan), else F.linear, then route.
        weights, ids = gate_and_route(x, self.gate, self.routing, self.gate_bias)  # [T, top_k] each
        if self.first_expert:
            ids = ids - self.first_expert  # ids of other ranks' experts fall outside [0, E_local)
        # the shared experts' partial is summed in: inside the routed experts' launches at decode shapes
        shared = self._shared_experts()
        return fused_moe(
            x, self.w13, self.w2, weights, ids, self.w13_scale, self.w2_scale, x_act=x_act, shared=shared
        )

    def _shared_experts(self) -> SharedExperts | None:
        """The shared experts as fused_moe takes them: their weights (read in place) and their MLP."""
        if self.shared is None:
            return None
        w13, w2 = self.shared.w13, self.shared.w2
        return SharedExperts(w13.weight, w2.weight, w13.scale, w2.scale, self._shared)

    def _shared(self, x: torch.Tensor, x_act: Fp8Act | None) -> torch.Tensor:  # [T, D] partial
        return self.shared(x_act if x_act is not None and self.shared.reads is Reads.FP8 else x)


class DecoderLayer(nn.Module):
    """Layer `layer` (its index in the KV cache and in the config's dense/MoE pattern), its tensors
    under `prefix` (default `layers.{layer}`; an MTP layer's block: `mtp.{k}`). `attn_ctx`: the
    attention's plan when it differs from the MLP's (SINGLE: DP attention); `options`: the
    attention's forms."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        layer: int,
        ctx: ParallelContext = SINGLE,
        prefix: str = "",
        attn_ctx: ParallelContext | None = None,
        options: ModelOptions = DEFAULTS,
    ):
        super().__init__()
        p = prefix or f"layers.{layer}"
        self.attn = MLAttention(config, weights, layer, ctx if attn_ctx is None else attn_ctx, p, options)
        self.attn_norm = RMSNorm(weights, f"{p}.attn_norm", config.rms_norm_eps, self.attn.reads)
        moe = config.is_moe_layer(layer)
        self.ffn = MoE(config, weights, layer, ctx, p) if moe else MLP(weights, f"{p}.mlp", ctx)
        # DP attention gathers the norm's output across ranks: a plain tensor, quantized after
        ffn_reads = Reads.X if attn_ctx is not None and attn_ctx is not ctx else self.ffn.reads
        self.ffn_norm = RMSNorm(weights, f"{p}.ffn_norm", config.rms_norm_eps, ffn_reads)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch | None,
        cache: PagedKVCache,
        exchange: TokenExchange | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP/MoE output, the residual stream before it): each
        residual add is fused into the norm that follows it (None: x is the embedding). With an
        `exchange` (DP attention) the MLP/MoE runs over every rank's tokens; `batch` None: this
        rank has no tokens (x [0, D]), it only joins the exchange."""
        h = x
        if batch is not None:
            if residual is None:
                h, residual = self.attn_norm(x), x
            else:
                h, residual = self.attn_norm(x, residual)
            h = self.attn(h, cos, sin, batch, cache)
            h, residual = self.ffn_norm(h, residual)
        if exchange is None:
            return self.ffn(h), residual
        return exchange.scatter(self.ffn.partial(exchange.gather(h))), residual  # [T_rank, D]


class MTPLayer(nn.Module):
    """MTP (NextN) layer k, the draft of speculative decoding (engine/spec/decode.py). From the main
    model's final-normed hidden state h_p at position p and the token t_{p+1}, it predicts t_{p+2}:

        x = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])   # [T, 2D] -> [T, D], embedding half first
        g = norm(block(x))                                 # [T, D]: what the head reads; a chained
                                                           # draft step reads it in place of h

    Its block is a decoder layer (tensors under `mtp.{k}.`) whose attention has its own pool in the
    KV cache, cache layer `num_hidden_layers + k`, at the same slots as the main layers. Embedding
    and head are the main model's (V3 ties them), unless the artifact stores the layer's own
    (`mtp.{k}.embed` / `.head`, compiler/mtp.py)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        k: int,
        main: tuple[VocabParallelEmbedding, ParallelLMHead],
        ctx: ParallelContext = SINGLE,
        options: ModelOptions = DEFAULTS,
    ):
        super().__init__()
        p, eps = f"mtp.{k}", config.rms_norm_eps
        self.layer = config.num_hidden_layers + k  # its pool in the KV cache
        self.enorm = RMSNorm(weights, f"{p}.enorm", eps)
        self.hnorm = RMSNorm(weights, f"{p}.hnorm", eps)
        self.eh_proj = Linear(weights, f"{p}.eh_proj")  # [D, 2D], replicated
        self.block = DecoderLayer(config, weights, self.layer, ctx, prefix=p, options=options)
        self.norm = RMSNorm(weights, f"{p}.norm", eps)
        own_embed, own_head = weights.has(f"{p}.embed"), weights.has(f"{p}.head")
        self.embed = (
            VocabParallelEmbedding(weights, f"{p}.embed", config.vocab_size, ctx) if own_embed else main[0]
        )
        self.head = ParallelLMHead(weights, f"{p}.head", ctx) if own_head else main[1]

    def forward(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """hidden [T, D] (h_p, or the previous draft step's g), token_ids [T] (t_{p+1}), packed as
        `batch` says (positions p) -> g [T, D]; writes position p's entry of the layer's pool."""
        e = self.enorm(self.embed(token_ids))
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden)], dim=-1))  # [T, D]
        x, residual = self.block(x, None, *cos_sin, batch, cache)
        return self.norm(x, residual)[0]


class DeepseekModel(nn.Module):
    """Embedding, decoder layers, final norm, LM head. Built from (and consumes) every tensor of a rank.

    `ctx` says which rank of which plan the tensors are (parallel.py); every rank of a plan runs
    the same forward in step, so that the collectives line up. `dp_attention`: the artifact's
    attention weights are whole (plan.dp_attention), each rank attends over its own tokens.
    `options`: the forms it runs (options.py), fixed here."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        ctx: ParallelContext = SINGLE,
        dp_attention: bool = False,
        options: ModelOptions = DEFAULTS,
    ):
        super().__init__()
        self.config = config
        self.ctx = ctx
        self.options = options
        self.embed = VocabParallelEmbedding(weights, "embed", config.vocab_size, ctx)  # [V_local, D]
        attn_ctx = SINGLE if dp_attention else ctx
        layers = (
            DecoderLayer(config, weights, i, ctx, attn_ctx=attn_ctx, options=options)
            for i in range(config.num_hidden_layers)
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(weights, "norm", config.rms_norm_eps)
        self.head = ParallelLMHead(weights, "head", ctx)  # [V_local, D]
        self.rope = RotaryEmbedding(config, device=self.device)
        n_mtp = sum(1 for k in range(config.num_nextn_predict_layers) if weights.has(f"mtp.{k}.eh_proj"))
        self.mtp = nn.ModuleList(
            MTPLayer(config, weights, k, (self.embed, self.head), ctx, options) for k in range(n_mtp)
        )
        weights.finish()
        route_fp8_linears(self, options.fp8_cublas, self.device, self.dtype)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        batch: ForwardBatch | None,
        cache: PagedKVCache,
        exchange: TokenExchange | None = None,
    ) -> torch.Tensor:
        """token_ids [T] (packed as `batch` says) -> final-normed hidden states [T, D]. With an
        `exchange` (DP attention): token_ids are every rank's, `batch` this rank's (None: it has
        none), and the result is this rank's rows [T_rank, D]."""
        x, residual = self.embed(token_ids), None  # vocab-parallel: all-reduced over the ranks
        if exchange is not None:
            x = exchange.own(x)  # [T_rank, D]
        if batch is None:  # DP attention, an idle rank: no attention, every collective
            cos = sin = None
        else:
            cos, sin = self.rope.cos_sin(batch.positions)  # [T, R] float32
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, batch, cache, exchange)
        return x if batch is None else self.norm(x, residual)[0]

    @torch.inference_mode()
    def draft(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        k: int = 0,
    ) -> torch.Tensor:
        """MTP layer k over hidden [T, D] and the next tokens [T] at batch.positions -> g [T, D]."""
        return self.mtp[k](hidden, token_ids, self.rope.cos_sin(batch.positions), batch, cache)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] float32 (the whole vocabulary, all-gathered on every rank)."""
        return self.head(hidden).float()

    def logits_into(self, hidden: torch.Tensor, out: torch.Tensor) -> None:
        """logits(hidden) written into `out` [N, V] float32 (a CUDA graph's buffer): the head's output
        cast in the copy, one pass, where .float() then copy_ made a float32 temporary (measured on
        one H100 at 256 rows: 157 against 61 us for V2-Lite's vocabulary)."""
        out.copy_(self.head(hidden))
