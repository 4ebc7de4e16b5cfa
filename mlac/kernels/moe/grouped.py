"""The grouped expert GEMMs of fused MoE: every token-expert pair, its rows grouped by expert.

    x       [T, D] bf16/fp16; with FP8 weights quantized per 128 channels here, or given so (x_act)
    w13     [E, 2I, D] gate rows, then up rows; w2 [E, D, I]: x's dtype, or e4m3 with block scales
            [E, ceil(rows/128), ceil(cols/128)] float32
    y       [T * top_k, D] in x's dtype: y[t * top_k + j] = expert_{ids[t, j]}(x[t])

Pairs p = t * top_k + j are grouped by expert into BLOCK_M-row blocks (align.py); GEMM1 computes
h[p] = silu(x[t] @ gate_e.T) * (x[t] @ up_e.T) per block, GEMM2 y[p] = h[p] @ w2_e.T. The top-k
sum of y is reduce.py's; the front that picks this path, and the reference, are fused.py's.
Roundings follow fused_moe_ref: gate, up, silu(gate), h and y are rounded to x's dtype, and with
FP8 weights h is re-quantized per pair per 128 channels (fused into GEMM1's epilogue).
At decode a few experts' blocks give too few tiles for the GPU: the GEMMs then split K
(MoeConfig.split_k), and the last split of each tile sums the float32 partials before the epilogue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlac.core.fp8 import BLOCK, FP8, FP8_MAX
from mlac.kernels.fp8_quant import (
    Fp8Act,
    act_quant,
    cast_out,
    interpreting,
    jit,
    pdl_launch,
    pdl_start,
    round_bf16,
    round_e4m3,
    tl,
    triton,
)
from mlac.kernels.gemm.fp8_gemm import sm_count, split_k_for, split_k_locks
from mlac.kernels.moe.align import moe_align


@dataclass(frozen=True)
class MoeConfig:
    """Tiles of the grouped GEMMs. With FP8 weights block_k and block_n1 must be 128."""

    block_m: int  # rows (pairs) per block: the per-expert padding unit
    block_n1: int  # GEMM1 columns of each half (gate, up)
    block_n2: int  # GEMM2 output columns
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8
    split_k: int = 1  # K ranges of each GEMM (reduced by the last CTA of a tile); 0: split_k_for picks


def pick_moe_config(num_pairs: int, num_experts: int, fp8: bool) -> MoeConfig:
    """Default tiles from the mean rows per expert: decode streams weights with 16-row blocks,
    prefill uses larger tiles (the padding unit is block_m, so it grows with the rows)."""
    rows = num_pairs / num_experts
    if rows <= 24:  # FP8: split K where the few experts' tiles leave SMs idle (split_k_for)
        return MoeConfig(16, 128, 128, 128, 4, 4, split_k=0) if fp8 else MoeConfig(16, 64, 64, 128)
    if rows <= 96:
        return MoeConfig(32, 128 if fp8 else 64, 128, 128, num_warps=4, num_stages=3)
    if fp8:
        return MoeConfig(64, 128, 128, 128, num_warps=8, num_stages=3)
    if rows < 128:
        return MoeConfig(64, 128, 128, 64, num_warps=8, num_stages=3)
    return MoeConfig(128, 128, 128, 64, num_warps=8, num_stages=3)


def _split_for(cfg: MoeConfig, tiles: int, k: int, device: torch.device) -> int:
    """K splits of one grouped GEMM: cfg.split_k (at most one per K block), or with 0 what
    `split_k_for` picks to fill the GPU (decode: a few experts' blocks give too few tiles)."""
    return split_of(cfg, tiles, k, sm_count(device))


def split_of(cfg: MoeConfig, tiles: int, k: int, sms: int) -> int:
    """`_split_for` on a GPU of `sms` SMs (pure: the warm-up plans with it)."""
    if cfg.split_k == 0:
        return split_k_for(tiles, k, sms)
    return max(1, min(cfg.split_k, -(-k // cfg.block_k)))


@jit(dynamic=("P", "num_blocks"))
def _moe_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    cs_ptr,
    ws_ptr,
    lock_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    N,
    K,
    num_blocks,
    A_ROW_DIV,
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_cm,
    stride_csm,
    GATED: tl.constexpr,  # b rows [0, N) gate, [N, 2N) up: c = silu(gate) * up
    FP8: tl.constexpr,  # a e4m3 + as [rows, ceil(K/128)]; b e4m3 + bs [E, ceil(rows/128), ceil(K/128)]
    QUANT_OUT: tl.constexpr,  # c e4m3 + cs [P, ceil(N/128)] (BLOCK_N == 128)
    ROUND_BF16: tl.constexpr,  # GATED: intermediates rounded like bf16 (else fp16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # K split over program_id(1); float32 partials in ws [SPLIT_K, rows, W]
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)

    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    row_ok = pair < P
    a_row = (pair // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    kb_total = tl.cdiv(K, BLOCK_K)
    kb_per_split = tl.cdiv(kb_total, SPLIT_K)
    kb_start = pid_k * kb_per_split
    kb_end = min(kb_start + kb_per_split, kb_total)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = kb_start * BLOCK_K + offs_k  # [BK] this split's first K columns
    a_ptrs = a_ptr + a_row[:, None] * stride_am + k0[None, :]  # [BM, BK]
    b_ptrs = b_ptr + expert * stride_be + offs_n[:, None].to(tl.int64) * stride_bn + k0[None, :]
    u_ptrs = b_ptrs + N * stride_bn  # up rows (GATED)
    as_ptrs = as_ptr + a_row * stride_asm  # [BM] (FP8)
    bs_ptrs = bs_ptr + expert * stride_bse + (offs_n // 128) * stride_bsn  # [BN] (FP8)
    us_ptrs = bs_ptr + expert * stride_bse + ((N + offs_n) // 128) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        if EVEN_K:
            a_mask = row_ok[:, None]
            b_mask = n_ok[:, None]
        else:
            k_ok = kb * BLOCK_K + offs_k < K
            a_mask = row_ok[:, None] & k_ok[None, :]
            b_mask = n_ok[:, None] & k_ok[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if UPCAST_DOT:  # interpreter only (see fp8_quant.interpreting)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if FP8:
            a_s = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
            b_s = tl.load(bs_ptrs + kb, mask=n_ok, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * (a_s[:, None] * b_s[None, :])
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        if GATED:
            u = tl.load(u_ptrs, mask=b_mask, other=0.0)
            if UPCAST_DOT:
                u = u.to(tl.float32)
            if FP8:
                u_s = tl.load(us_ptrs + kb, mask=n_ok, other=0.0)
                acc_u += tl.dot(a, tl.trans(u)) * (a_s[:, None] * u_s[None, :])
            else:
                acc_u = tl.dot(a, tl.trans(u), acc_u)
            u_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if SPLIT_K > 1:  # the last split of this tile to arrive gets the sums, in split order
        slot = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] padded row
        tile = pid_m * num_pid_n + pid_n
        acc, acc_u, last = _split_k_sum(
            acc, acc_u, ws_ptr, lock_ptr, tile, pid_k, slot, offs_n, row_ok[:, None] & n_ok[None, :],
            num_blocks * BLOCK_M, N, GATED, SPLIT_K,
        )  # fmt: skip
        row_ok = row_ok & last  # only the CTA that holds the sums stores
    c_rows = pair.to(tl.int64)[:, None] * stride_cm
    c_mask = row_ok[:, None] & n_ok[None, :]
    if GATED:
        if ROUND_BF16:
            gate = round_bf16(acc)
            up = round_bf16(acc_u)
            h = round_bf16(round_bf16(gate / (1.0 + tl.exp(-gate))) * up)
        else:
            gate = acc.to(tl.float16).to(tl.float32)
            up = acc_u.to(tl.float16).to(tl.float32)
            h = ((gate / (1.0 + tl.exp(-gate))).to(tl.float16).to(tl.float32) * up).to(tl.float16)
            h = h.to(tl.float32)
    else:
        h = acc
    if QUANT_OUT:  # one 128-channel group per tile: quantize like quantize_act_ref
        h_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(h), axis=1), 1e-12), FP8_MAX_C)  # [BM]
        q = round_e4m3(tl.clamp(tl.math.div_rn(h, h_s[:, None]), -FP8_MAX_C, FP8_MAX_C))
        tl.store(c_ptr + c_rows + offs_n[None, :], q.to(c_ptr.dtype.element_ty), mask=c_mask)
        tl.store(cs_ptr + pair.to(tl.int64) * stride_csm + pid_n, h_s, mask=row_ok)
    else:
        tl.store(c_ptr + c_rows + offs_n[None, :], cast_out(h, c_ptr.dtype.element_ty), mask=c_mask)


@jit
def _split_k_sum(acc, acc_u, ws_ptr, lock_ptr, tile, pid_k, rows, cols, mask, num_rows, N,
                 GATED: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """Split-K reduction in the GEMM's launch (as fp8_gemm's): each split stores its float32
    partials (acc, and acc_u when GATED, at columns N + n) to ws [SPLIT_K, num_rows, N or 2N]; a
    per-tile counter elects the last split to arrive, which sums them in split order (so results
    are deterministic) and resets the counter. -> (sum, sum_u, [BM] True where this CTA is the last)."""
    width = 2 * N if GATED else N
    ptrs = ws_ptr + rows[:, None].to(tl.int64) * width + cols[None, :]  # [BM, BN] of split 0
    split_stride = num_rows.to(tl.int64) * width
    tl.store(ptrs + pid_k * split_stride, acc, mask=mask)
    if GATED:
        tl.store(ptrs + pid_k * split_stride + N, acc_u, mask=mask)
    tl.debug_barrier()
    arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
    # [BM, BN] / [BM] masks built by arithmetic: the interpreter rejects a scalar mask broadcast
    last_rows = (rows * 0 + arrived) == SPLIT_K - 1  # [BM]: all True in the last split's CTA
    last = last_rows[:, None] & mask  # [BM, BN]
    total = tl.zeros_like(acc)
    total_u = tl.zeros_like(acc_u)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(ptrs + s * split_stride, mask=last, other=0.0, cache_modifier=".cg")
        if GATED:
            total_u += tl.load(ptrs + s * split_stride + N, mask=last, other=0.0, cache_modifier=".cg")
    if arrived == SPLIT_K - 1:
        tl.atomic_xchg(lock_ptr + tile, 0)
    return total, total_u, last_rows


def _split_buffers(
    split: int, rows: int, width: int, tiles: int, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 partials [split, rows, width], the tile counters) for split > 1; else `out` twice
    (unused by the kernel)."""
    if split == 1:
        return out, out
    ws = torch.empty(split, rows, width, dtype=torch.float32, device=out.device)
    return ws, split_k_locks(out.device, tiles)


def _checked_act(x_act: Fp8Act, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = x_act.q, x_act.scale
    assert q.shape == x.shape and q.dtype == FP8 and q.stride(-1) == 1, (q.shape, q.dtype, q.stride())
    assert s.shape == (x.shape[0], math.ceil(x.shape[1] / BLOCK)) and s.dtype == torch.float32, s.shape
    return q, s


def moe_grouped_gemms(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    x_act: Fp8Act | None,
    cfg: MoeConfig,
) -> torch.Tensor:
    """GEMM1 and GEMM2 of every pair: y [T * top_k, D] in x's dtype, y[t * top_k + j] = expert
    ids[t, j] on x[t] with fused_moe_ref's roundings; rows of pairs whose expert is outside [0, E)
    are not written. Launches: moe_align, [act_quant, unless x_act is given], GEMM1 (+SiLU*up, +FP8
    re-quant), GEMM2; a GEMM split over K (cfg.split_k) reduces its splits in its own launch.
    Arguments checked by `fused_moe_triton`; topk_ids contiguous, T * top_k > 0."""
    t, d = x.shape
    e, two_i, _ = w13.shape
    i = two_i // 2
    top_k = topk_ids.shape[1]
    p = t * top_k
    fp8 = w13_scale is not None
    if fp8:
        assert cfg.block_k == cfg.block_n1 == BLOCK, f"FP8 MoE needs 128-wide K and GEMM1 tiles: {cfg}"
    sorted_pairs, block_expert, num_padded = moe_align(topk_ids, e, cfg.block_m)
    num_blocks = block_expert.numel()
    x = x if x.stride(-1) == 1 else x.contiguous()
    if fp8:
        a, a_s = act_quant(x) if x_act is None else _checked_act(x_act, x)
        h = torch.empty(p, i, dtype=FP8, device=x.device)
        h_s = torch.empty(p, triton.cdiv(i, BLOCK), dtype=torch.float32, device=x.device)
        s13, s2 = w13_scale, w2_scale
    else:
        a = a_s = x
        h = torch.empty(p, i, dtype=x.dtype, device=x.device)
        h_s = s13 = s2 = h  # unused
    common = dict(
        FP8=fp8,
        BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        FP8_MAX_C=FP8_MAX,
        UPCAST_DOT=not fp8 and interpreting(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    tiles1 = num_blocks * triton.cdiv(i, cfg.block_n1)
    split1 = _split_for(cfg, tiles1, d, x.device)
    ws1, locks1 = _split_buffers(split1, num_blocks * cfg.block_m, 2 * i, tiles1, h)
    _moe_gemm_kernel[(tiles1, split1)](
        a,
        a_s,
        w13,
        s13,
        h,
        h_s,
        ws1,
        locks1,
        sorted_pairs,
        block_expert,
        num_padded,
        p,
        i,
        d,
        num_blocks,
        top_k,
        a.stride(0),
        a_s.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        h.stride(0),
        h_s.stride(0),
        GATED=True,
        QUANT_OUT=fp8,
        ROUND_BF16=x.dtype == torch.bfloat16,
        BLOCK_N=cfg.block_n1,
        SPLIT_K=split1,
        EVEN_K=d % cfg.block_k == 0,
        **common,
        **pdl_launch(),
    )
    y = torch.empty(p, d, dtype=x.dtype, device=x.device)
    tiles2 = num_blocks * triton.cdiv(d, cfg.block_n2)
    split2 = _split_for(cfg, tiles2, i, x.device)
    ws2, locks2 = _split_buffers(split2, num_blocks * cfg.block_m, d, tiles2, y)
    _moe_gemm_kernel[(tiles2, split2)](
        h,
        h_s,
        w2,
        s2,
        y,
        y,
        ws2,
        locks2,
        sorted_pairs,
        block_expert,
        num_padded,
        p,
        d,
        i,
        num_blocks,
        1,
        h.stride(0),
        h_s.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        y.stride(0),
        0,
        GATED=False,
        QUANT_OUT=False,
        ROUND_BF16=True,
        BLOCK_N=cfg.block_n2,
        SPLIT_K=split2,
        EVEN_K=i % cfg.block_k == 0,
        **common,
        **pdl_launch(),
    )
    return y
