"""The CUDA-graph decode batch sizes and the per-rank memory plan of an artifact (pure arithmetic).

    decode_buckets(256)                      # [1, 2, 4, 8, 16, 32, ..., 240, 256]
    plan_buckets(config, options, tensors)   # -> BucketPlan, stored as manifest.buckets

The runtime captures one graph per bucket (largest first, one shared pool), pads a decode batch
to the next bucket (a batch above the largest replays it in pieces, runtime/worker/graphs.py: so
--max-running-requests needs no bucket of its own, and a larger batch no more activations), and
gives its KV cache what is left of the GPU after the weights, the graph pool and the prefill
activations (mlac/runtime/worker/memory_plan.py). The buckets pass (mlac/passes/buckets.py)
records the plan in the manifest; the runtime recomputes it for an artifact that predates it.

Weight bytes are exact. Activation bytes are an ESTIMATE: the largest intermediates of one step
on one rank, summed as if they were live at once, times SAFETY_FACTOR (2) for what the sum leaves
out: temporaries of ops not listed, the caching allocator's rounding (2 MiB segments), FP8
activation copies and scales, the sampler. Sizes (local = on one rank of --tp N):

    T tokens of the step, D hidden, V vocab, H_l = H/N heads, C kv_lora, R rope, nope, v,
    q = q_lora_rank (0 when absent), k experts per token, P = T·k token-expert pairs,
    E_l experts on a rank (E with --ep 1, E/N with --ep N), I_l = I_moe/N (--ep 1) or I_moe (--ep N),
    I_s = I_moe·n_shared/N, I_d = intermediate_size/N, V_l = V/N; bf16 = 2 bytes, f32 = 4.

    hidden  = HIDDEN_COPIES · T·D·2                   residual, normed, attention out, mlp out [T, D]
    decode attention (absorbed form, T = B):
            = T·(q + C + R)·2                         w_qkv_a / w_kv_a output [T, q + C + R]
            + T·H_l·(nope + R)·2                      q [T, H_l, nope + R]
            + 2 · T·H_l·C·2                           q_lat and o_lat [T, H_l, C]
            + T·H_l·MAX_SPLITS·(C + 1)·4              split-KV partials o [T, H_l, S, C], lse [T, H_l, S]
            + T·H_l·v·2                               v [T, H_l, v]
    prefill attention (MHA form over the chunk's own S = T tokens; see the NOTE below):
            = T·(q + C + R)·2 + 2 · T·H_l·(nope + R)·2 + T·H_l·nope·2 + 2 · T·H_l·v·2
                                                      q, k [T, H_l, nope + R], k_nope, v and o [T, H_l, v]
    ffn     = max over the model's layer kinds of
            dense: T·3·I_d·2                          gate|up [T, 2I_d] and silu·up [T, I_d]
            MoE:   2 · T·E·4                          router logits and scores [T, E] f32
                   + P·2·I_l·2 + P·D·2                fused-MoE rows [P, 2I_l] (gate|up) and [P, D]
                   + 2 · (P + min(P, E_l)·(MOE_BLOCK_M − 1))·4
                                                      alignment index arrays, int32 (padding per expert)
                   + T·3·I_s·2                        shared experts, as dense
    logits  = L·(V_l·2 + V·2 + V·4)                   local head [L, V_l], gathered [L, V], float [L, V]
              with L = T for decode, min(T, PREFILL_SEQUENCES) for prefill (last token of each sequence)

    activation(T) = ceil(SAFETY_FACTOR · (hidden + max(attention, ffn, logits)))

The graph pool is the activation of the largest bucket: graphs captured largest-first reuse its
blocks. NOTE: prefill is planned for one chunk without a cached prefix; a chunk that continues a
long prompt in the MHA form also decompresses its prefix (S·H_l·(nope + R + v)·2 bytes more).
"""

from __future__ import annotations

import math

from mlac.core.artifact import BucketPlan, CompileOptions, TensorEntry
from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError

MAX_BS = 4096
LADDER_HEAD = (1, 2, 4, 8)  # then multiples of LADDER_STEP
LADDER_STEP = 16
SAFETY_FACTOR = 2.0
HIDDEN_COPIES = 4
MAX_SPLITS = 64  # the most split-KV chunks mla_decode_plan.choose_num_splits picks
MOE_BLOCK_M = 128  # the largest per-expert padding unit grouped.pick_moe_config picks
# Mirrors of mlac.runtime.engine.options.SchedulerConfig defaults (core does not import the runtime;
# tests/core/test_plan.py checks that they agree).
PREFILL_TOKENS = 2048  # chunked_prefill_size
PREFILL_SEQUENCES = 64  # max_running_requests: logits rows of a prefill step
BF16, F32, I32 = 2, 4, 4
KV_ITEMSIZE = {"bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}  # bf16: the runtime's compute dtype


def decode_buckets(max_bs: int) -> list[int]:
    """The default ladder, ascending: 1, 2, 4, 8, then multiples of 16 up to max_bs, and max_bs
    itself when it is not on the ladder. max_bs must be in 1..4096."""
    if not isinstance(max_bs, int) or not 1 <= max_bs <= MAX_BS:
        raise MlacError(f"--cuda-graph-max-bs {max_bs}: must be an integer in 1..{MAX_BS}")
    ladder = [b for b in LADDER_HEAD if b <= max_bs]
    ladder += list(range(LADDER_STEP, max_bs + 1, LADDER_STEP))
    return ladder if ladder[-1] == max_bs else [*ladder, max_bs]


def plan_buckets(
    config: ModelConfig, options: CompileOptions, tensors: list[dict[str, TensorEntry]]
) -> BucketPlan:
    """The buckets and memory plan of an artifact whose rank r holds `tensors[r]` (the manifest's
    tensor entries, as written)."""
    sizes = decode_buckets(options.cuda_graph_max_bs)
    decode = [activation_bytes(config, options, b, prefill=False) for b in sizes]
    return BucketPlan(
        decode_batch_sizes=sizes,
        cuda_graph_max_bs=options.cuda_graph_max_bs,
        weight_bytes=[weight_bytes(rank) for rank in tensors],
        kv_bytes_per_token=kv_bytes_per_token(config, options),
        activation_bytes=decode,
        graph_pool_bytes=decode[-1],
        prefill_tokens=PREFILL_TOKENS,
        prefill_activation_bytes=activation_bytes(config, options, PREFILL_TOKENS, prefill=True),
        safety_factor=SAFETY_FACTOR,
    )


def weight_bytes(tensors: dict[str, TensorEntry]) -> int:
    """Exact bytes of one rank's tensor data (safetensors headers left out)."""
    from mlac.core.safetensors_io import DTYPES  # torch: here, not at import (the options chain imports plan)

    return sum(math.prod(e.shape) * DTYPES[e.dtype].itemsize for e in tensors.values())


def kv_bytes_per_token(config: ModelConfig, options: CompileOptions) -> int:
    """One token's latent cache on one rank, all layers (the latent is replicated across TP ranks)."""
    return config.num_hidden_layers * config.kv_latent_dim * KV_ITEMSIZE[options.kv_cache_dtype]


def activation_bytes(config: ModelConfig, options: CompileOptions, tokens: int, prefill: bool) -> int:
    """Estimated peak transient bytes of one step of `tokens` tokens on one rank (module docstring)."""
    attn = (
        _prefill_attention(config, options, tokens) if prefill else _decode_attention(config, options, tokens)
    )
    rows = min(tokens, PREFILL_SEQUENCES) if prefill else tokens
    # DP attention: a decode bucket counts rows per rank; the MLP / MoE and the head see every rank's
    if options.dp_attention and not prefill:
        tokens, rows = tokens * options.tp, rows * options.tp
    body = max(attn, _ffn(config, options, tokens), _logits(config, options, rows))
    return math.ceil(SAFETY_FACTOR * (HIDDEN_COPIES * tokens * config.hidden_size * BF16 + body))


def _latent_in(c: ModelConfig, t: int) -> int:
    return t * ((c.q_lora_rank or 0) + c.kv_lora_rank + c.qk_rope_head_dim) * BF16  # [T, q + C + R]


def _local_heads(c: ModelConfig, o: CompileOptions) -> int:
    """Heads one rank attends with: all of them under DP attention (its own tokens only)."""
    return c.num_attention_heads if o.dp_attention else c.num_attention_heads // o.tp


def _decode_attention(c: ModelConfig, o: CompileOptions, t: int) -> int:
    h, kv = _local_heads(c, o), c.kv_lora_rank
    q = t * h * c.qk_head_dim * BF16  # [T, H_l, nope + R]
    lat = 2 * t * h * kv * BF16  # q_lat, o_lat [T, H_l, C]
    partials = t * h * MAX_SPLITS * (kv + 1) * F32  # o [T, H_l, S, C], lse [T, H_l, S]
    return _latent_in(c, t) + q + lat + partials + t * h * c.v_head_dim * BF16


def _prefill_attention(c: ModelConfig, o: CompileOptions, t: int) -> int:
    h = _local_heads(c, o)
    qk = 2 * t * h * c.qk_head_dim * BF16  # q, k [T, H_l, nope + R]
    k_nope = t * h * c.qk_nope_head_dim * BF16  # [T, H_l, nope]
    return _latent_in(c, t) + qk + k_nope + 2 * t * h * c.v_head_dim * BF16  # v, o [T, H_l, v]


def _ffn(c: ModelConfig, o: CompileOptions, t: int) -> int:
    moe_layers = [c.is_moe_layer(i) for i in range(c.num_hidden_layers)]
    dense = _dense_mlp(t, c.intermediate_size // o.tp) if not all(moe_layers) else 0
    return max(dense, _moe(c, o, t) if any(moe_layers) else 0)


def _dense_mlp(t: int, inter_local: int) -> int:
    return t * 3 * inter_local * BF16  # gate|up [T, 2I], silu·up [T, I]


def _moe(c: ModelConfig, o: CompileOptions, t: int) -> int:
    e = c.n_routed_experts or 0
    e_local = e // o.ep
    inter = c.moe_intermediate_size // o.tp if o.ep == 1 else c.moe_intermediate_size
    p = t * c.num_experts_per_tok
    router = 2 * t * e * F32  # logits, scores [T, E]
    rows = p * 2 * inter * BF16 + p * c.hidden_size * BF16  # [P, 2I_l], [P, D]
    index = 2 * (p + min(p, e_local) * (MOE_BLOCK_M - 1)) * I32  # sorted pairs + ranks, padded
    shared = _dense_mlp(t, c.moe_intermediate_size * c.n_shared_experts // o.tp)
    return router + rows + index + shared


def _logits(c: ModelConfig, o: CompileOptions, rows: int) -> int:
    v = c.vocab_size
    return rows * (v // o.tp * BF16 + v * BF16 + v * F32)  # [L, V_l], gathered [L, V], float [L, V]
