"""Fused MoE at decode, GEMM2 per token with the top-k sum in the same launch (MoeDecodeConfig.fuse_sum).

    h    [T * top_k + n * T, I]  GEMM1's output (decode.py), rows laid out as it writes them
    out  [T, D] = sum_j topk_weights[t, j] * round(w2_{ids[t, j]} @ h[t * top_k + j])
                  + sum_c round(shared chunk c's w2 @ h[T * top_k + c * T + t]) (+ shared_out[t])

One program per (token, N block) takes the token's top_k experts (and the n shared chunks,
shared.py) as KPAD slots and writes the weighted sum, summed in float32 and rounded once, so the
top-k reduce launch (reduce.py) goes away: one launch fewer than GEMM2 per expert, on CUDA cores,
about one row per expert. Deterministic (no atomics, fixed summation order). The reference:
fused.py's fused_moe_ref.
"""

from __future__ import annotations

import torch

from mlac.core.fp8 import BLOCK, FP8_MAX
from mlac.kernels.fp8_quant import cast_out, jit, pdl_launch, pdl_start, round_bf16, tl, triton
from mlac.kernels.moe.decode_config import MoeDecodeConfig, check_decode
from mlac.kernels.moe.decode_tiles import expert_args, k_step, load_a, load_scales, shared_args, slice_dot
from mlac.kernels.moe.shared import SharedExperts


@jit(dynamic=("T",))
def _moe_decode_down_sum_kernel(
    h_ptr,
    b_ptr,
    bs_ptr,
    sb_ptr,
    sbs_ptr,
    ids_ptr,
    tw_ptr,
    out_ptr,
    shared_ptr,
    T,
    N,
    K,
    E,
    stride_hm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_sbe,
    stride_sbn,
    stride_sbse,
    stride_sbsn,
    stride_out,
    stride_shared,
    TOP_K: tl.constexpr,
    N_SHARED: tl.constexpr,  # shared chunks: sb [N_SHARED, N, K], their h rows T * TOP_K + c * T + t
    KPAD: tl.constexpr,  # TOP_K + N_SHARED rounded up to a power of two
    A_MODE: tl.constexpr,  # 0 h as stored; 2 quantize h here (FP8 weights)
    FP8_W: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,  # 128-column blocks per K step
    FP8_MAX_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    # out[t, n] = sum_j tw[t, j] * round(w2_{ids[t, j]} row n . h[t * TOP_K + j])
    #             + sum_c round(shared chunk c's row n . h[T * TOP_K + c * T + t]) (+ shared[t, n]),
    # in float32 over the pairs whose expert is in [0, E), rounded once; one program per (t, N block)
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    offs_j = tl.arange(0, KPAD)  # slots: TOP_K routed pairs, then N_SHARED shared chunks
    routed = offs_j < TOP_K
    chunk = (offs_j - TOP_K).to(tl.int64)  # [KPAD] (shared slots)
    shared = (offs_j >= TOP_K) & (offs_j < TOP_K + N_SHARED)
    pair = tl.where(shared, T * TOP_K + chunk * T + t, t * TOP_K + offs_j)  # [KPAD] rows of h
    expert = tl.load(ids_ptr + t * TOP_K + offs_j, mask=routed, other=-1)
    ok = (routed & (expert >= 0) & (expert < E)) | shared  # [KPAD]
    e64 = tl.where(ok & routed, expert, 0).to(tl.int64)
    w = tl.where(shared, sb_ptr + chunk * stride_sbe, b_ptr + e64 * stride_be)  # [KPAD]
    stride_n = tl.where(shared, stride_sbn, stride_bn).to(tl.int64)
    rows = w[:, None] + offs_n.to(tl.int64)[None, :] * stride_n[:, None]  # [KPAD, BN]
    b_rows = rows[:, :, None, None]  # [KPAD, BN, 1, 1]
    ws = tl.where(shared, sbs_ptr + chunk * stride_sbse, bs_ptr + e64 * stride_bse)  # [KPAD]
    stride_sn = tl.where(shared, stride_sbsn, stride_bsn).to(tl.int64)
    bs_rows = ws[:, None, None] + (offs_n // 128)[None, :, None] * stride_sn[:, None, None]
    jn_ok = ok[:, None] & n_ok[None, :]  # [KPAD, BN]
    acc = tl.zeros((KPAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, SUB * 128):
        k, k_ok, kb, kb_ok = k_step(k0, K, SUB)
        a = load_a(h_ptr, h_ptr, pair, ok, k, k_ok, kb, kb_ok, stride_hm, 0, A_MODE, FP8_MAX_C)
        b_mask = jn_ok[:, :, None, None] & k_ok[None, None, :, :]
        b = tl.load(b_rows + k[None, None, :, :], mask=b_mask, other=0.0)  # [KPAD, BN, SUB, 128]
        s_mask = jn_ok[:, :, None] & kb_ok[None, None, :]
        b_s = load_scales(bs_rows + kb[None, None, :], s_mask, FP8_W)  # [KPAD, BN, SUB]
        acc += slice_dot(a[:, None, :, :], b, b_s, FP8_W)
    if out_ptr.dtype.element_ty == tl.bfloat16:  # each expert's output rounded as the reference's
        y = round_bf16(acc)
    else:
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    tw = tl.load(tw_ptr + t * TOP_K + offs_j, mask=ok & routed, other=0.0).to(tl.float32)  # [KPAD]
    tw = tl.where(shared, 1.0, tw)
    total = tl.sum(tl.where(jn_ok, y * tw[:, None], 0.0), axis=0)  # [BN]
    if HAS_SHARED:
        total += tl.load(shared_ptr + t * stride_shared + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs_n, cast_out(total, out_ptr.dtype.element_ty), mask=n_ok)


def moe_decode_down_sum(
    h: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w2_scale: torch.Tensor | None,
    shared_out: torch.Tensor | None,
    out: torch.Tensor,
    cfg: MoeDecodeConfig,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """GEMM2 per token with the top-k sum: out [T, D] = sum_j topk_weights[t, j] * y[t * top_k + j]
    over the pairs whose expert is in [0, E) (y rounded to out's dtype as in fused_moe_ref), plus
    with `shared` the n shared chunks' y (weight 1.0, h rows as `moe_decode_gate_up` lays them out),
    plus shared_out, summed in float32 and rounded once. Deterministic. Returns out."""
    t, d = out.shape
    e, _, i = w2.shape
    top_k = topk_ids.shape[1]
    n_shared = 0 if shared is None else shared.w2.shape[-1] // i
    fp8 = w2_scale is not None
    check_decode(topk_ids.numel(), topk_ids, cfg)
    b, b_s, *strides = expert_args(w2, w2_scale)
    sb, sb_s, *shared_strides = shared_args(shared, False, i, w2, w2_scale)
    shared_rows = out if shared_out is None else shared_out  # unused without shared_out
    _moe_decode_down_sum_kernel[(t, triton.cdiv(d, cfg.block_n2))](
        h, b, b_s, sb, sb_s, topk_ids, topk_weights.contiguous(), out, shared_rows,
        t, d, i, e,
        h.stride(0), *strides, *shared_strides, out.stride(0), shared_rows.stride(0),
        TOP_K=top_k, N_SHARED=n_shared, KPAD=triton.next_power_of_2(top_k + n_shared), A_MODE=2 if fp8 else 0,
        FP8_W=fp8, HAS_SHARED=shared_out is not None, BLOCK_N=cfg.block_n2, SUB=cfg.block_k // BLOCK,
        FP8_MAX_C=FP8_MAX, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(),
    )  # fmt: skip
    return out
