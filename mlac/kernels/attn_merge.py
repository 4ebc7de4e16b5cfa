"""Merge two attention results over disjoint key sets, in place, by their log-sum-exps.

For each query row and head, with o_a, o_b each normalized by its own softmax sum and lse_a, lse_b
their natural-log log-sum-exps,

    o = (exp(lse_a - m) o_a + exp(lse_b - m) o_b) / (exp(lse_a - m) + exp(lse_b - m)),  m = max(lse)

is the softmax attention over the union of the two key sets. Used by the shared-prefix extend
(runtime/attention_forms.extend_shared): the rows of `o` listed in `rows` (all of them when `rows`
is None) take in the partials `o_b` of the same rows over the shared prefix, one launch.

    o [T, H, D] (updated), lse [T, H] float32, o_b [Q, H, D], lse_b [Q, H] float32, rows [Q] int64

Both lse finite (every row has at least one key in each set). Computes in float32 and rounds to
o's dtype once. `merge_attention` dispatches: Triton on CUDA, the reference on CPU.
"""

from __future__ import annotations

import torch

from mlac.kernels._triton import pdl_launch, pdl_start, tl, triton
from mlac.kernels._triton import use_triton as _use_triton


def merge_attention_ref(
    o: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """The merge in float32 torch ops: o[rows] updated, returned."""
    idx = slice(None) if rows is None else rows
    a, lse_a = o[idx].float(), lse[idx]
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m)[..., None], torch.exp(lse_b - m)[..., None]
    merged = ((a * wa + o_b.float() * wb) / (wa + wb)).to(o.dtype)
    if rows is None:
        return o.copy_(merged)
    return o.index_copy_(0, rows, merged)


if triton is not None:

    @triton.jit
    def _merge_kernel(
        o, lse, o_b, lse_b, rows,
        stride_o_t, stride_o_h, stride_l_t, stride_ob_t, stride_ob_h, stride_lb_t,
        H, D, HAS_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One program per row q of o_b: o[rows[q]] (o[q] without rows) merged with o_b[q]."""
        pdl_start(PDL)
        q = tl.program_id(0).to(tl.int64)
        t = tl.load(rows + q).to(tl.int64) if HAS_ROWS else q
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = offs_h < H
        mask = mask_h[:, None] & (offs_d[None, :] < D)
        la = tl.load(lse + t * stride_l_t + offs_h, mask=mask_h, other=0.0)
        lb = tl.load(lse_b + q * stride_lb_t + offs_h, mask=mask_h, other=0.0)
        m = tl.maximum(la, lb)
        wa = tl.exp(la - m)
        wb = tl.exp(lb - m)
        pa = o + t * stride_o_t + offs_h[:, None] * stride_o_h + offs_d[None, :]
        pb = o_b + q * stride_ob_t + offs_h[:, None] * stride_ob_h + offs_d[None, :]
        a = tl.load(pa, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(pb, mask=mask, other=0.0).to(tl.float32)
        out = (a * wa[:, None] + b * wb[:, None]) / (wa + wb)[:, None]
        tl.store(pa, out.to(o.dtype.element_ty), mask=mask)


def merge_attention(
    o: torch.Tensor,  # [T, H, D], updated in place
    lse: torch.Tensor,  # [T, H] float32
    o_b: torch.Tensor,  # [Q, H, D]
    lse_b: torch.Tensor,  # [Q, H] float32
    rows: torch.Tensor | None = None,  # [Q] int64: o's rows; None: Q == T, row for row
    use_triton: bool | None = None,
) -> torch.Tensor:
    """o[rows] <- the merge of (o[rows], lse[rows]) and (o_b, lse_b) (module docstring); returns o."""
    q, h, d = o_b.shape
    assert o.shape[1:] == (h, d) and lse.shape == o.shape[:2] and lse_b.shape == (q, h)
    assert rows is not None or q == o.shape[0], "without rows, o_b must hold every row of o"
    assert o.stride(-1) == 1 and o_b.stride(-1) == 1 and lse.stride(-1) == 1 and lse_b.stride(-1) == 1
    if not _use_triton(o, use_triton):
        return merge_attention_ref(o, lse, o_b, lse_b, rows)
    if q == 0:
        return o
    _merge_kernel[(q,)](
        o, lse, o_b, lse_b, o if rows is None else rows,
        o.stride(0), o.stride(1), lse.stride(0), o_b.stride(0), o_b.stride(1), lse_b.stride(0),
        h, d, HAS_ROWS=rows is not None, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
        num_warps=8 if triton.next_power_of_2(h) * triton.next_power_of_2(d) >= 8192 else 4, **pdl_launch(),
    )  # fmt: skip
    return o
