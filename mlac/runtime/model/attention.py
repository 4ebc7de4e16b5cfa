"""The two exact forms of MLA prefill/extend attention over cached latents, and the rule between them.

Per head h, with latent c [S, C] and rope key r [S, R] of every cached token, and the absorbed
weights w_kc [H, nope, C], w_vc [H, C, v]:

- MHA form: decompress k_nope = c · w_kc[h]ᵀ and v = c · w_vc[h] for all S tokens, then attention
  with head dims nope + R (192) and v (128). Costs 2·S·H·C·(nope + v) FLOPs up front, then cheap
  attention.
- Absorbed form: q_lat = q_nope · w_kc[h] (T rows only), MQA of [q_lat ‖ q_rope] over the latents
  themselves (head dims C + R = 576 and C = 512), then o = o_lat · w_vc[h]. No decompression, but
  each (query, key) pair costs 576 + 512 instead of 192 + 128 multiply-adds.

Both give the same result up to rounding. Decompression is paid per cached token and the wider
attention per (query, key) pair, so the absorbed form wins when each sequence adds few tokens to a
long cache (chunked prefill continuations, speculative verification), the MHA form when it adds many.

Decode (one new token per sequence) always runs absorbed, over the paged cache: `decode_absorbed`.
Its last head_bmm merges mla_decode's split-KV partials while loading them and, for an FP8 o_proj,
quantizes its own output (kernels/head_bmm.py): 3 launches (head_bmm, split-KV attention, head_bmm)
where there were up to 5 (+ the split merge when num_splits > 1, + o_proj's act_quant when FP8).
The merge moves into head_bmm only up to FUSED_MERGE_MAX_SPLITS splits (see there); `fuse_out`
False (ModelOptions.fused_mla_out, for tests) gives the separate merge and act_quant launches back.
Decode rows of one sequence (a flattened extend, a speculative verify: graphs.py) may run
grouped (`row_groups`, kernels/attention/mla_decode.py): one program per group loads each KV tile
once for all its rows. The CUDA graphs choose the form per step (mla_decode_plan.prefer_row_groups):
64 rows after 2,000 cached tokens 50.1 against 91.2 us per row, 4 verify rows 20.0 against 26.3 us
(H200, benchmarks/results/kernels_mla_rows_h200.json).
With `paged` (the step's FlashInfer MLA wrapper, planned by the runner's attention backend:
RuntimeOptions.attention_backend "flashinfer") the attention between the two head_bmms is
FlashInfer's instead of mla_decode: its output is merged already, so the last head_bmm merges
nothing; prefill and extend steps keep mlac's kernels either way.

Sequences of an extend step that share cached blocks (prefix-cache hits on one system prompt,
kvcache/shared_prefix.py) attend to them in one launch (`extend_shared`, cascade attention), in
the MHA form: the prefix's latents are read and decompressed once, however many sequences share
it, and each sharer attends to them and then to its own tokens. `prefer_shared` is the rule, where
ModelOptions.shared_prefix is on (the default; off for tests that compare the plain extend).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from mlac.core.fp8 import BLOCK
from mlac.kernels.attention.extend import extend_attention
from mlac.kernels.attention.head_bmm import head_bmm
from mlac.kernels.attention.mla_decode import mla_decode
from mlac.kernels.attention.mla_decode_plan import decode_num_splits
from mlac.kernels.fp8_quant import Fp8Act
from mlac.runtime.kvcache.shared_prefix import SharedPrefix

if TYPE_CHECKING:
    from mlac.kernels.attention.flashinfer_mla import PagedMLA

# head_bmm's merge reloads every used split's partials for each of its K steps. On an H200
# (benchmarks/kernels/mla_out.py, V2-Lite, benchmarks/results/kernels_mla_out_router_h200.txt) it
# beat the merge launch at 8 splits (batch 32, 256 tokens: 24.4 against 27.0 us) and lost at 32-64
# splits (batch 1, 256 tokens: 21.6 against 17.0 us; in the decode step 367.6 against 389.1 tok/s,
# FP8): more splits merge in their own launch.
FUSED_MERGE_MAX_SPLITS = 8

# Largest kv-weighted mean of new tokens per sequence for which the absorbed form is chosen.
# FLOP break-even: decompression 2·C·(nope + v) = 262144 per cached token per head against
# 2·(C + R + C - nope - R - v) = 1536 extra per pair -> about 170 new tokens per sequence.
# Measured on an H200 (benchmarks/kernels/attention.py, "extend forms"; 16 and 128 heads, 8 sequences
# on a 4096-token prefix): absorbed 0.45-0.48 ms vs MHA 0.67-0.68 ms up to 64 new tokens each, MHA
# ahead from 128 (0.70 vs 0.92 ms). A lone 256-token prompt still favoured absorbed (0.14 vs
# 0.18 ms), a 4096-token one MHA (0.38 vs 1.91 ms).
ABSORBED_MAX_Q_LEN = 64


def prefer_absorbed(q_lens: Sequence[int], ctx_lens: Sequence[int]) -> bool:
    """True when the absorbed form is the cheaper one for this batch: the kv-weighted mean number of
    new tokens per sequence, Σ q_i·kv_i / Σ kv_i, is at most ABSORBED_MAX_Q_LEN."""
    kv_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    pairs = sum(q * kv for q, kv in zip(q_lens, kv_lens, strict=True))
    return pairs <= ABSORBED_MAX_Q_LEN * sum(kv_lens)


def extend_mha(
    q_nope: torch.Tensor,  # [T, H, nope]
    q_rope: torch.Tensor,  # [T, H, R] roped
    kv: torch.Tensor,  # [S, C + R] every sequence's cached tokens, packed
    w_kc: torch.Tensor,  # [H, nope, C]
    w_vc: torch.Tensor,  # [H, C, v]
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    shared: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:  # [T, H, v]
    """MHA form: K and V decompressed per head from every cached latent. `shared`: extend_attention's
    (the first P rows of kv a prefix that the sequences with shares != 0 attend to first)."""
    c = w_kc.shape[-1]
    latent, k_rope = kv.split([c, kv.shape[-1] - c], dim=-1)
    # [H, S, nope] and [H, S, v] products, used as [S, H, ...] views (last dim contiguous)
    k_nope = torch.matmul(latent, w_kc.transpose(1, 2)).transpose(0, 1)
    v = torch.matmul(latent, w_vc).transpose(0, 1)
    k = torch.cat([k_nope, k_rope[:, None, :].expand(-1, w_kc.shape[0], -1)], dim=-1)  # [S, H, nope + R]
    q = torch.cat([q_nope, q_rope], dim=-1)  # [T, H, nope + R]
    return extend_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, scale, max_seqlen_q=max_seqlen_q, shared=shared
    )


def extend_absorbed(
    q_nope: torch.Tensor,  # [T, H, nope]
    q_rope: torch.Tensor,  # [T, H, R] roped
    kv: torch.Tensor,  # [S, C + R] every sequence's cached tokens, packed
    w_kc: torch.Tensor,  # [H, nope, C]
    w_vc: torch.Tensor,  # [H, C, v]
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
) -> torch.Tensor:  # [T, H, v]
    """Absorbed form: MQA over the latents (one shared K = latent ‖ rope, V = latent)."""
    c = w_kc.shape[-1]
    q_lat = head_bmm(q_nope, w_kc)  # [T, H, C]
    q = torch.cat([q_lat, q_rope.to(q_lat.dtype)], dim=-1)  # [T, H, C + R]
    k = kv[:, None, :]  # [S, 1, C + R]
    v = kv[:, None, :c]  # [S, 1, C], a view: last dim contiguous
    o_lat = extend_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv, scale, max_seqlen_q=max_seqlen_q)
    return head_bmm(o_lat, w_vc)  # [T, H, v]


def prefer_shared(
    length: int,
    sums: tuple[int, int, int],
    w_kc: torch.Tensor,  # [H, nope, C]
    w_vc: torch.Tensor,  # [H, C, v]
    rope: int,
) -> bool:
    """True when the cascade (extend_shared) over a shared prefix of `length` tokens costs fewer
    FLOPs than the plain extend in its cheaper form; `sums` is shared_prefix.step_sums of the step
    (keys, own keys past the prefix, pairs). Per head, decompressing a token costs 2·C·(nope + v),
    a (query, key) pair 2·(nope + R + v) in the MHA form and 2·(C + R + C) in the absorbed one. Both
    score the same pairs; the cascade decompresses the prefix once plus each sequence's own keys,
    the plain MHA form every sequence's whole context. At DeepSeek's dims after a 2,000-token
    prefix it pays from 3 sequences of 64 new tokens."""
    nope, c = w_kc.shape[-2:]
    v = w_vc.shape[-1]
    decompress, mha_pair, absorbed_pair = 2 * c * (nope + v), 2 * (nope + rope + v), 2 * (c + rope + c)
    keys, own, pairs = sums
    plain = min(pairs * absorbed_pair, keys * decompress + pairs * mha_pair)
    return (length + own) * decompress + pairs * mha_pair < plain


def extend_shared(
    q_nope: torch.Tensor,  # [T, H, nope]
    q_rope: torch.Tensor,  # [T, H, R] roped
    kv: torch.Tensor,  # [P + S', C + R] the shared prefix, then every sequence's tokens past it
    w_kc: torch.Tensor,  # [H, nope, C]
    w_vc: torch.Tensor,  # [H, C, v]
    shared: SharedPrefix,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
) -> torch.Tensor:  # [T, H, v]
    """Extend attention with a shared cached prefix (runtime/shared_prefix.py), in the MHA form: the
    prefix's latents decompressed once, one launch over [prefix ‖ each sequence's own tokens]."""
    return extend_mha(
        q_nope, q_rope, kv, w_kc, w_vc, cu_seqlens_q, shared.cu_seqlens_kv, max_seqlen_q, scale,
        shared=(shared.shares, shared.length),
    )  # fmt: skip


def decode_absorbed(
    q_nope: torch.Tensor,  # [B, H, nope]
    q_rope: torch.Tensor,  # [B, H, R] roped
    kv_cache: torch.Tensor,  # [blocks, block_size, C + R] paged latents, bf16 or FP8 with kv_scale
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, the new token included
    scale: float,
    kv_scale: torch.Tensor | None,
    w_kc: torch.Tensor,  # [H, nope, C]
    w_vc: torch.Tensor,  # [H, C, v]
    quant_out: bool = False,
    row_groups: torch.Tensor | None = None,  # [2, B] int32: the grouped form (mla_decode)
    fuse_out: bool = True,
    paged: PagedMLA | None = None,
) -> torch.Tensor | Fp8Act:  # [B, H·v]
    """Absorbed decode, one new token per sequence: q_lat = q_nope·w_kc, MQA over the paged latents,
    o = o_lat·w_vc, flattened to o_proj's input [B, H·v]. `quant_out` (o_proj is FP8) returns its
    `Fp8Act` instead: the bits o_proj's own act_quant would give (made by head_bmm when `fuse_out`
    and v % 128 == 0, else o_proj quantizes the tensor returned). `fuse_out`: head_bmm merges the
    split-KV partials (up to FUSED_MERGE_MAX_SPLITS splits) and quantizes; False: the merge kernel
    and act_quant apart. `row_groups`: rows of one sequence attend in groups (mla_decode's grouped
    form; same result). `paged`: FlashInfer's kernel planned for these rows, in mla_decode's place
    (it reads the pool through the block tables it was planned with; no FP8 cache, no row groups)."""
    q_lat = head_bmm(q_nope, w_kc)  # [B, H, C] contiguous
    if paged is not None:
        o_lat = paged.run(q_lat, q_rope, kv_cache)  # [B, H, C], merged
    else:
        splits = decode_num_splits(q_lat, kv_cache, block_tables, grouped=row_groups is not None)
        fuse_merge = fuse_out and splits <= FUSED_MERGE_MAX_SPLITS
        o_lat = mla_decode(
            q_lat, q_rope, kv_cache, block_tables, seq_lens, scale, kv_scale,
            merge=not fuse_merge, num_splits=splits, row_groups=row_groups,
        )  # fmt: skip
    quant_out = quant_out and fuse_out and w_vc.shape[-1] % BLOCK == 0
    o = head_bmm(o_lat, w_vc, quant_out=quant_out)  # [B, H, v] (o_lat may be SplitKV partials)
    return o if quant_out else o.flatten(1)


__all__ = [
    "ABSORBED_MAX_Q_LEN",
    "FUSED_MERGE_MAX_SPLITS",
    "decode_absorbed",
    "extend_absorbed",
    "extend_mha",
    "extend_shared",
    "prefer_absorbed",
    "prefer_shared",
]
