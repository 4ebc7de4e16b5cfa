"""Split-KV partials of MLA decode and their merge by log-sum-exp: the kernel, its wrapper, the reference.

mla_decode splits long sequences into `num_splits` chunks computed in parallel; each split s of
row b writes its own softmax-normalized o and its log-sum-exp (base 2):

    o_part [B, H, S, C] float32,  lse_part [B, H, S] float32
    o_lat[b, h] = sum_s 2^(lse_s - mx) o_s / sum_s 2^(lse_s - mx)   over the splits row b used

Row b uses the first `used_splits(seq_lens[b], S, min_split)` splits (each of at least min_split
tokens); the others hold garbage and are never read. The merge runs in its own launch
(`merge_split_kv`), or inside the consumer of o_lat while it loads it (head_bmm's v-absorb, from a
`SplitKV`): both through `merge_weights` / `merge_splits`, so both give the same bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mlac.kernels._triton import pdl_launch, pdl_start, tl, triton

# Splits whose partial rows the merge kernel loads at once (8 warps: 2 registers a [512] row).
MERGE_CHUNK = 32


class SplitKV(NamedTuple):
    """mla_decode's split-KV partials, not merged (`merge=False`): what a consumer that merges them
    while loading o_lat takes instead of o_lat [B, H, C] (head_bmm).

    o_part [B, H, S, C] float32: each split's o, normalized by its own softmax sum.
    lse_part [B, H, S] float32: each split's log-sum-exp, base 2 (-inf for an empty split).
    seq_lens [B] int32: the lengths that set each row's split partition (its seq_len; in the
    grouped form its group's longest row's): row b wrote only the first
    `used_splits(seq_lens[b], S, min_split)` splits; the others hold garbage and must not be read.
    dtype: o_lat's dtype; the merge rounds to it (as the merge kernel's store does).
    """

    o_part: torch.Tensor
    lse_part: torch.Tensor
    seq_lens: torch.Tensor
    min_split: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:  # o_lat's [B, H, C]
        b, h, _, c = self.o_part.shape
        return torch.Size((b, h, c))

    @property
    def device(self) -> torch.device:
        return self.o_part.device


def used_splits_ref(seq_lens: torch.Tensor, num_splits: int, min_split: int) -> torch.Tensor:
    """[B] splits each request uses: at most num_splits, each of at least min_split tokens, >= 1."""
    return (-(-seq_lens.long() // min_split)).clamp(max=num_splits).clamp(min=1)


def merge_ref(p: SplitKV) -> torch.Tensor:
    """The split partials merged by log-sum-exp in float32 -> o_lat [B, H, C] in p.dtype (same
    math as the merge kernel, up to float32 summation order and exp2 rounding)."""
    s = p.o_part.shape[2]
    used = used_splits_ref(p.seq_lens, s, p.min_split).to(p.o_part.device)  # [B]
    valid = (torch.arange(s, device=used.device)[None, :] < used[:, None])[:, None, :]  # [B, 1, S]
    lse = p.lse_part.masked_fill(~valid, float("-inf"))  # [B, H, S]
    mx = lse.amax(-1, keepdim=True)
    w = torch.exp2(lse - mx.masked_fill(mx == float("-inf"), 0.0))  # [B, H, S], 0 where unused
    denom = w.sum(-1, keepdim=True)
    o = (w[..., None] * p.o_part.masked_fill(~valid[..., None], 0.0)).sum(2)  # [B, H, C]
    return (o / denom.masked_fill(denom == 0, 1.0)).to(p.dtype)


if triton is not None:

    @triton.jit
    def used_splits(seq_len, num_splits, MIN_SPLIT: tl.constexpr):
        """Splits one request uses: at most num_splits, each of at least MIN_SPLIT tokens."""
        return tl.maximum(tl.minimum(num_splits, tl.cdiv(seq_len, MIN_SPLIT)), 1)

    # The split merge, shared by the merge kernel and head_bmm's merging x load, so that both give
    # the same bits: each element's sums run in split order, one add (or fma) per split, whatever
    # the shapes and chunk sizes (a split past an element's `used` is masked to -inf / 0 and adds
    # exactly +0; floating-point adds are never reordered). CHUNK splits are unrolled per loop
    # step, so that their loads are in flight together.

    @triton.jit
    def merge_weights(lse_ptrs, stride_s, ok, used, n_iter, CHUNK: tl.constexpr):
        """(mx, denom) of the log-sum-exp merge over the splits s < used of each element of
        `lse_ptrs` (base-2 lse, any shape; `ok` masks elements, `used` broadcasts to them): mx the
        largest finite lse (0 where none is), denom = sum_s 2^(lse_s - mx). Visits the splits
        s < n_iter rounded up to CHUNK (n_iter >= every element's used)."""
        mx = tl.load(lse_ptrs, mask=ok, other=float("-inf"))  # split 0: always used
        for s0 in range(1, n_iter, CHUNK):
            for j in tl.static_range(CHUNK):
                lse = tl.load(lse_ptrs + (s0 + j) * stride_s, mask=ok & (s0 + j < used), other=float("-inf"))
                mx = tl.maximum(mx, lse)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        denom = tl.exp2(tl.load(lse_ptrs, mask=ok, other=float("-inf")) - mx)
        for s0 in range(1, n_iter, CHUNK):
            for j in tl.static_range(CHUNK):
                lse = tl.load(lse_ptrs + (s0 + j) * stride_s, mask=ok & (s0 + j < used), other=float("-inf"))
                denom += tl.exp2(lse - mx)
        return mx, denom

    @triton.jit
    def merge_splits(
        o_ptrs, stride_o_s, o_ok, lse_ptrs, stride_l_s, ok, used, n_iter, mx, denom, CHUNK: tl.constexpr
    ):
        """sum_s 2^(lse_s - mx) o_s / denom over the splits s < used: the merged float32 o at
        `o_ptrs` (split 0's partials; `o_ok` masks them, `lse_ptrs`/`ok`/`used` broadcast to
        them), with (mx, denom) from merge_weights."""
        w = tl.exp2(tl.load(lse_ptrs, mask=ok, other=float("-inf")) - mx)
        acc = w * tl.load(o_ptrs, mask=o_ok & ok, other=0.0)
        for s0 in range(1, n_iter, CHUNK):
            for j in tl.static_range(CHUNK):
                u = ok & (s0 + j < used)
                w = tl.exp2(tl.load(lse_ptrs + (s0 + j) * stride_l_s, mask=u, other=float("-inf")) - mx)
                acc = tl.fma(w, tl.load(o_ptrs + (s0 + j) * stride_o_s, mask=o_ok & u, other=0.0), acc)
        return acc / tl.where(denom == 0.0, 1.0, denom)

    @triton.jit
    def _mla_decode_merge_kernel(
        o_part, lse_part, out, lse_out,
        stride_p_b, stride_p_h, stride_p_s, stride_pl_b, stride_pl_h,
        stride_o_b, stride_o_h, stride_lo_b, seq_lens, num_splits,
        MIN_SPLIT: tl.constexpr, DL: tl.constexpr, BLOCK_DL: tl.constexpr, MERGE_CHUNK: tl.constexpr,
        STORE_LSE: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One program per (request, head): o = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max),
        over the splits request b used (merge_weights, merge_splits)."""
        pdl_start(PDL)
        h = tl.program_id(0)
        b = tl.program_id(1)
        offs_d = tl.arange(0, BLOCK_DL)
        n_used = used_splits(tl.load(seq_lens + b), num_splits, MIN_SPLIT)
        # The per-request operands as a [1] row, not scalars: Triton's interpreter cannot AND a
        # scalar mask with a vector one.
        row = tl.arange(0, 1)
        used = row + n_used  # [1]
        ok = used > 0  # [1], true
        lse_ptrs = lse_part + b * stride_pl_b + h * stride_pl_h + row  # [1]
        mx, denom = merge_weights(lse_ptrs, 1, ok, used, n_used, MERGE_CHUNK)  # [1]
        p_ptrs = o_part + b * stride_p_b + h * stride_p_h + offs_d  # [BDL]
        res = merge_splits(
            p_ptrs, stride_p_s, offs_d < DL, lse_ptrs, 1, ok, used, n_used, mx, denom, MERGE_CHUNK
        )
        tl.store(
            out + b * stride_o_b + h * stride_o_h + offs_d, res.to(out.dtype.element_ty), mask=offs_d < DL
        )
        if STORE_LSE:
            tl.store(lse_out + b * stride_lo_b + h + row, (mx + tl.log2(denom)) * 0.6931471805599453)


def merge_split_kv(p: SplitKV, out: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """The merge kernel: p's partials merged into out [B, H, C] (rounded to out's dtype) and, with
    `lse` [B, H] float32, the merged log-sum-exp (natural log). One program per (row, head), splits
    summed in split order (`merge_splits`). Returns out."""
    b, h, num_splits, c = p.o_part.shape
    o_part, lse_part = p.o_part, p.lse_part
    assert out.shape == (b, h, c) and out.stride(-1) == 1, (tuple(out.shape), (b, h, c))
    _mla_decode_merge_kernel[(h, b)](
        o_part, lse_part, out, lse if lse is not None else lse_part,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0, p.seq_lens, num_splits,
        MIN_SPLIT=p.min_split, MERGE_CHUNK=MERGE_CHUNK,
        DL=c, BLOCK_DL=triton.next_power_of_2(c), STORE_LSE=lse is not None,
        num_warps=8, **pdl_launch(),
    )  # fmt: skip
    return out
