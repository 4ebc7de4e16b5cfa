"""The top-k reduce of fused MoE: each token's weighted sum over its experts' outputs.

    y            [P', D] per-pair outputs (P = T * top_k pairs first: row t * top_k + j), x's dtype
    topk_weights [T, top_k], topk_ids [T, top_k] (contiguous; ids outside [0, E) are skipped)
    shared_rows  [n, T, D] or None: rows added with weight 1.0 (the shared MLP's output, or the
                 shared chunks' rows of y)
    out          [T, D] = sum_j w[t, j] * y[t * top_k + j] + sum_c shared_rows[c, t]

Summed in float32 and rounded once, as fused_moe_ref (fused.py) sums. Both paths of fused_moe end
here: the grouped GEMMs (grouped.py) always, the decode GEMVs (decode.py) unless GEMM2 sums the
top-k in its own launch (decode_sum.py). BLOCK_T grows with T (`reduce_blocks`: a variant the
warm-up must meet, step_variants.py).
"""

from __future__ import annotations

import torch

from mlac.kernels.fp8_quant import cast_out, jit, pdl_launch, pdl_start, tl, triton
from mlac.kernels.gemm.fp8_gemm import next_power_of_2


@jit(dynamic=("T",))
def _moe_reduce_kernel(
    y_ptr,
    w_ptr,
    ids_ptr,
    out_ptr,
    shared_ptr,
    T,
    D,
    E,
    stride_y,
    stride_out,
    stride_ss,
    stride_shared,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N_SHARED: tl.constexpr,  # rows of shared [N_SHARED, T, D] to add
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    # out[t] = sum_j w[t, j] * y[t * TOP_K + j] over the pairs whose expert is in [0, E)
    # (+ sum_c shared[c, t]), summed in float32 and rounded once
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    t_ok = t < T
    d_ok = offs < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair, mask=t_ok, other=-1)
        ok = t_ok & (e >= 0) & (e < E)
        w = tl.where(ok, tl.load(w_ptr + pair, mask=ok, other=0.0).to(tl.float32), 0.0)
        y_mask = ok[:, None] & d_ok[None, :]
        y = tl.load(y_ptr + pair[:, None] * stride_y + offs[None, :], mask=y_mask, other=0.0)
        acc += y.to(tl.float32) * w[:, None]
    for c in tl.static_range(N_SHARED):
        s_ptrs = shared_ptr + c * stride_ss + t[:, None] * stride_shared + offs[None, :]
        acc += tl.load(s_ptrs, mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    out = cast_out(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t[:, None] * stride_out + offs[None, :], out, mask=t_ok[:, None] & d_ok[None, :])


def reduce_blocks(t: int, d: int) -> tuple[int, int]:
    """`_moe_reduce_kernel`'s (BLOCK_T, BLOCK_D) for out [t, d]: BLOCK_T grows with t up to
    4096 // BLOCK_D (a constexpr picked per step: 1, 2, then 4 at DeepSeek's widths)."""
    block_d = min(1024, next_power_of_2(d))
    return min(max(1, 4096 // block_d), next_power_of_2(t)), block_d


def reduce_top_k(
    y: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    out: torch.Tensor,
    shared_rows: torch.Tensor | None,
) -> torch.Tensor:
    """out [T, D] = sum_j topk_weights[t, j] * y[t * top_k + j] over pairs whose expert is in
    [0, num_experts) (+ sum_c shared_rows[c], shared_rows [n, T, D]: the shared MLP's output, or the
    shared chunks' rows of y), summed in float32 and rounded once; rows of y of other pairs are not
    read. Arguments checked by `fused_moe_triton`; topk_ids contiguous."""
    t, d = out.shape
    top_k = topk_ids.shape[1]
    block_t, block_d = reduce_blocks(t, d)
    _moe_reduce_kernel[(triton.cdiv(t, block_t), triton.cdiv(d, block_d))](
        y,
        topk_weights.contiguous(),
        topk_ids,
        out,
        out if shared_rows is None else shared_rows,  # unused without shared rows
        t,
        d,
        num_experts,
        y.stride(0),
        out.stride(0),
        0 if shared_rows is None else shared_rows.stride(0),
        0 if shared_rows is None else shared_rows.stride(1),
        TOP_K=top_k,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        N_SHARED=0 if shared_rows is None else shared_rows.shape[0],
        num_warps=4,
        **pdl_launch(),
    )
    return out
