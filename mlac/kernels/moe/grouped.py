"""Fused MoE: the grouped expert GEMMs (the routing that feeds them: moe_routing.py).

Experts are stacked: w13 [E, 2I, D] (gate rows, then up rows), w2 [E, D, I], bf16/fp32 or e4m3
with block scales [E, ceil(rows/128), ceil(cols/128)]. `fused_moe` dispatches on device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mlac.core.fp8 import BLOCK, FP8, FP8_MAX, dequantize_blocks
from mlac.kernels.fp8_quant import (
    HAS_TRITON,
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
from mlac.kernels.fp8_quant import use_triton as _use_triton
from mlac.kernels.gemm.fp8_gemm import (
    fp8_act_linear_ref,
    fp8_linear_ref,
    next_power_of_2,
    sm_count,
    split_k_for,
    split_k_locks,
)
from mlac.kernels.moe.decode import (
    MoeDecodeConfig,
    SharedExperts,
    moe_decode_down,
    moe_decode_down_sum,
    moe_decode_gate_up,
    pick_moe_decode_config,
    shared_chunks,
    shared_widens_sum,
)


def _expert_linear(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, x_act: Fp8Act | None = None
) -> torch.Tensor:
    if scale is None:
        return F.linear(x, w.to(x.dtype))
    if x_act is not None:  # x's quantization, made by its producer
        return fp8_act_linear_ref(x_act, w, scale, x.dtype)
    return fp8_linear_ref(x, w, scale)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    shared_out: torch.Tensor | None = None,
    x_act: Fp8Act | None = None,
) -> torch.Tensor:
    """x [T, D] -> sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t]), [T, D] in x's dtype.

    expert(x) = w2 @ (silu(gate) * up), gate/up = halves of w13 @ x. Expert ids outside
    [0, E) are skipped (they belong to another rank under expert parallelism). shared_out
    [T, D] in x's dtype (the shared experts' output) is added to the float32 sum before its one
    rounding: (routed_f32 + shared_out.float()).to(x.dtype). x_act: see `fused_moe`.
    """
    t, d = x.shape
    e, two_i, _ = w13.shape
    out = torch.zeros(t, d, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        if not 0 <= expert < e:
            continue
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        x_rows = None if x_act is None else Fp8Act(x_act.q[token], x_act.scale[token], x.dtype)
        h = _expert_linear(x[token], w13[expert], None if w13_scale is None else w13_scale[expert], x_rows)
        gate, up = h.split(two_i // 2, dim=-1)
        y = _expert_linear(F.silu(gate) * up, w2[expert], None if w2_scale is None else w2_scale[expert])
        out.index_add_(0, token, y.to(torch.float32) * topk_weights[token, slot, None].to(torch.float32))
    if shared_out is not None:
        out += shared_out.to(torch.float32)
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Triton path. Token-expert pairs p = t * top_k + j are grouped by expert into BLOCK_M-row blocks
# (moe_align); GEMM1 computes h[p] = silu(x[t] @ gate_e.T) * (x[t] @ up_e.T) per block, GEMM2
# y[p] = h[p] @ w2_e.T, and a last pass sums out[t] = sum_j w[t, j] * y[p] over valid experts.
# Roundings follow fused_moe_ref: gate, up, silu(gate), h and y are rounded to x's dtype, and with
# FP8 weights h is re-quantized per pair per 128 channels (fused into GEMM1's epilogue).
# At decode a few experts' blocks give too few tiles for the GPU: the GEMMs then split K
# (MoeConfig.split_k), and the last split of each tile sums the float32 partials before the epilogue.


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


@jit(dynamic=("P", "max_padded", "max_blocks"))
def _moe_align_kernel(
    ids_ptr,
    counts_ptr,
    rank_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    E,
    max_padded,
    max_blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BCHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    # One program. counts_ptr [E_PAD] and rank_ptr [P] are scratch.
    e_offs = tl.arange(0, E_PAD)
    tl.store(counts_ptr + e_offs, tl.zeros([E_PAD], dtype=tl.int32))
    tl.debug_barrier()
    for start in range(0, P, CHUNK):  # rank of each pair within its expert (any order will do)
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        valid = (ids >= 0) & (ids < E)
        rank = tl.atomic_add(counts_ptr + tl.where(valid, ids, 0), 1, mask=valid)
        tl.store(rank_ptr + offs, rank, mask=valid)
    tl.debug_barrier()
    counts = tl.load(counts_ptr + e_offs, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [E_PAD] inclusive
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.debug_barrier()
    tl.store(counts_ptr + e_offs, ends - padded)  # counts_ptr now holds each expert's first slot
    for start in range(0, max_padded, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + P, mask=offs < max_padded)
    for start in range(0, max_blocks, BCHUNK):
        blk = start + tl.arange(0, BCHUNK)
        first = blk * BLOCK_M
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)  # [BCHUNK]
        expert = tl.where(first < total, expert, -1)
        tl.store(block_expert_ptr + blk, expert, mask=blk < max_blocks)
    tl.debug_barrier()
    for start in range(0, P, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        valid = (ids >= 0) & (ids < E)
        rank = tl.load(rank_ptr + offs, mask=valid, other=0, cache_modifier=".cg")
        first = tl.load(counts_ptr + tl.where(valid, ids, 0), mask=valid, other=0, cache_modifier=".cg")
        tl.store(sorted_ptr + first + rank, offs, mask=valid)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group token-expert pairs by expert, each expert padded to a multiple of block_m rows.

    topk_ids [T, k] -> (sorted_pairs [max_padded] int32: pair index t * k + j, or T * k as
    padding; block_expert [max_blocks] int32: expert of each block, -1 past the end;
    num_padded [1] int32). Sizes depend on T, k, E and block_m only (CUDA-graph safe):
    max_padded = T*k + min(T*k, E) * (block_m - 1). Ids outside [0, E) are left out.
    Order inside an expert is unspecified.
    """
    assert HAS_TRITON, "moe_align needs triton"
    assert topk_ids.dim() == 2 and topk_ids.is_contiguous(), topk_ids.shape
    p = topk_ids.numel()
    max_padded, max_blocks = align_sizes(p, num_experts, block_m)
    dev = topk_ids.device
    e_pad = triton.next_power_of_2(num_experts)
    counts = torch.empty(e_pad, dtype=torch.int32, device=dev)
    rank = torch.empty(max(p, 1), dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](
        topk_ids,
        counts,
        rank,
        sorted_pairs,
        block_expert,
        num_padded,
        p,
        num_experts,
        max_padded,
        max_blocks,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        CHUNK=1024,
        BCHUNK=max(16, 8192 // e_pad),
        num_warps=8,
        **pdl_launch(),
    )
    return sorted_pairs, block_expert, num_padded


def align_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """`moe_align`'s (max_padded, max_blocks) for num_pairs token-expert pairs: each expert that can
    hold a pair padded by up to block_m - 1 rows."""
    max_padded = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return max_padded, -(-max_padded // block_m)


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


def _check_moe_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale) -> None:
    t, d = x.shape
    e, two_i, d1 = w13.shape
    i = two_i // 2
    assert d1 == d and two_i == 2 * i, f"w13 {tuple(w13.shape)} vs x [*, {d}]"
    assert tuple(w2.shape) == (e, d, i), f"w2 {tuple(w2.shape)}, expected {(e, d, i)}"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == t, (topk_ids.shape, t)
    assert not topk_ids.is_floating_point(), topk_ids.dtype
    assert x.dtype in (torch.bfloat16, torch.float16), f"Triton MoE takes bf16/fp16 x, got {x.dtype}"
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1, "expert weights need contiguous rows"
    if w13_scale is None:
        assert w2_scale is None and w13.dtype == w2.dtype == x.dtype, (w13.dtype, w2.dtype, x.dtype)
        return
    assert w2_scale is not None and w13.dtype == w2.dtype == FP8, (w13.dtype, w2.dtype)
    assert w13_scale.dtype == w2_scale.dtype == torch.float32
    assert tuple(w13_scale.shape) == (e, math.ceil(two_i / BLOCK), math.ceil(d / BLOCK)), w13_scale.shape
    assert tuple(w2_scale.shape) == (e, math.ceil(d / BLOCK), math.ceil(i / BLOCK)), w2_scale.shape
    assert w13_scale.stride(-1) == 1 and w2_scale.stride(-1) == 1


def _split_for(cfg: MoeConfig, tiles: int, k: int, device: torch.device) -> int:
    """K splits of one grouped GEMM: cfg.split_k (at most one per K block), or with 0 what
    `split_k_for` picks to fill the GPU (decode: a few experts' blocks give too few tiles)."""
    return split_of(cfg, tiles, k, sm_count(device))


def split_of(cfg: MoeConfig, tiles: int, k: int, sms: int) -> int:
    """`_split_for` on a GPU of `sms` SMs (pure: the warm-up plans with it)."""
    if cfg.split_k == 0:
        return split_k_for(tiles, k, sms)
    return max(1, min(cfg.split_k, -(-k // cfg.block_k)))


def moe_variants(t: int, top_k: int, num_experts: int, d: int, i: int, fp8: bool, sms: int) -> list[tuple]:
    """The grouped path's kernel variants (one tuple per kernel: its name and the integers Triton
    compiles it for) that `fused_moe_triton` launches for a step of t tokens: x [t, d], w13
    [num_experts, 2i, d], on a GPU of `sms` SMs. What the warm-up must meet (step_variants.py)."""
    p = t * top_k
    decode = pick_moe_decode_config(p, num_experts, fp8)
    if decode is not None:  # the decode GEMVs, and the top-k reduce unless GEMM2 sums
        return [("moe_decode", decode)] + ([] if decode.fuse_sum else [("moe_reduce", *reduce_blocks(t, d))])
    cfg = pick_moe_config(p, num_experts, fp8)
    num_blocks = align_sizes(p, num_experts, cfg.block_m)[1]
    split1 = split_of(cfg, num_blocks * -(-i // cfg.block_n1), d, sms)
    split2 = split_of(cfg, num_blocks * -(-d // cfg.block_n2), i, sms)
    return [
        ("moe_align", cfg.block_m),
        ("moe_gemm1", cfg, split1),
        ("moe_gemm2", cfg, split2),
        ("moe_reduce", *reduce_blocks(t, d)),
    ]


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


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    config: MoeConfig | MoeDecodeConfig | None = None,
    shared_out: torch.Tensor | None = None,
    x_act: Fp8Act | None = None,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """Triton fused MoE; contract as `fused_moe_ref` (x bf16/fp16; weights in x's dtype or e4m3).

    Launches: [act_quant, unless x_act is given], moe_align, GEMM1 (+SiLU*up, +FP8 re-quant), GEMM2,
    top-k reduce (+ shared_out, added in float32 before the one rounding). A GEMM split over K
    (config.split_k) reduces its splits in its own launch. Decode shapes (a few rows per expert:
    `pick_moe_decode_config`, or a MoeDecodeConfig given) run moe_decode's GEMVs instead: GEMM1,
    GEMM2 and top-k reduce, or GEMM2 with the top-k sum in one launch (MoeDecodeConfig.fuse_sum).
    `shared` (instead of shared_out): the shared experts, inside the decode GEMVs' launches where
    `shared_chunks` takes them, else their own MLP (`shared.mlp`, run first) as shared_out.
    """
    _check_moe_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    t, d = x.shape
    e, two_i, _ = w13.shape
    i = two_i // 2
    top_k = topk_ids.shape[1]
    p = t * top_k
    fp8 = w13_scale is not None
    cfg = config or pick_moe_decode_config(p, e, fp8) or pick_moe_config(p, e, fp8)
    n_shared = shared_chunks(shared, w13, w13_scale) if isinstance(cfg, MoeDecodeConfig) and p > 0 else 0
    widens = n_shared and cfg.fuse_sum and shared_widens_sum(top_k, n_shared)
    fused = shared if n_shared and not widens else None
    if shared is not None:
        assert shared_out is None, "give the shared experts as shared_out or as shared, not both"
        shared_out = None if fused is not None else shared.mlp(x, x_act)
    if shared_out is not None:
        assert shared_out.shape == x.shape and shared_out.dtype == x.dtype, tuple(shared_out.shape)
        assert shared_out.stride(-1) == 1 and shared_out.device == x.device, "shared_out: contiguous rows"
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if p == 0:
        return out.zero_() if shared_out is None else out.copy_(shared_out)
    topk_ids = topk_ids.contiguous()
    if isinstance(cfg, MoeDecodeConfig):
        args = (x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
        return _decode_moe(*args, cfg, shared_out, x_act if fp8 else None, fused, out)
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
    return _reduce_top_k(y, topk_weights, topk_ids, e, out, _as_rows(shared_out))


def _decode_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    cfg: MoeDecodeConfig,
    shared_out: torch.Tensor | None,
    x_act: Fp8Act | None,
    shared: SharedExperts | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """The decode GEMVs of moe_decode into out [T, D]: GEMM1, then GEMM2 with the top-k sum or
    GEMM2 and `_reduce_top_k`; with `shared` (fitting: `shared_chunks`) its chunks ride along in
    each launch and are summed with weight 1.0 (shared_out is then None)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    h = moe_decode_gate_up(x, w13, topk_ids, w13_scale, x_act, cfg, shared)
    if cfg.fuse_sum:
        return moe_decode_down_sum(h, w2, topk_weights, topk_ids, w2_scale, shared_out, out, cfg, shared)
    y = moe_decode_down(h, w2, topk_ids, w2_scale, cfg, shared)  # [P + n * T, D]
    p = topk_ids.numel()
    rows = _as_rows(shared_out) if shared is None else y[p:].unflatten(0, (-1, x.shape[0]))  # [n, T, D]
    return _reduce_top_k(y, topk_weights, topk_ids, w13.shape[0], out, rows)


def _as_rows(shared_out: torch.Tensor | None) -> torch.Tensor | None:
    """The shared MLP's output [T, D] as `_reduce_top_k`'s shared rows [1, T, D]."""
    return None if shared_out is None else shared_out.unsqueeze(0)


def reduce_blocks(t: int, d: int) -> tuple[int, int]:
    """`_moe_reduce_kernel`'s (BLOCK_T, BLOCK_D) for out [t, d]: BLOCK_T grows with t up to
    4096 // BLOCK_D (a constexpr picked per step: 1, 2, then 4 at DeepSeek's widths)."""
    block_d = min(1024, next_power_of_2(d))
    return min(max(1, 4096 // block_d), next_power_of_2(t)), block_d


def _reduce_top_k(
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
    read. topk_ids contiguous."""
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


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
    config: MoeConfig | MoeDecodeConfig | None = None,
    shared_out: torch.Tensor | None = None,
    x_act: Fp8Act | None = None,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """Dispatching entry point (Triton on CUDA, reference on CPU); contract as fused_moe_ref
    (shared_out [T, D] in x's dtype: returns routed + shared_out with one rounding).

    shared: the shared experts (their weights and their MLP) in place of shared_out: at decode
    shapes on the Triton path they run inside the routed experts' launches (`fused_moe_triton`),
    elsewhere `shared.mlp(x, x_act)` gives shared_out.

    x_act: with FP8 weights, x already quantized by its producer (must be `quantize_act_ref(x)`'s
    bits, an `rms_norm_quant` say): GEMM1 reads it instead of quantizing x again. x is still
    needed (the output's shape and dtype; the reference's bf16 path). Ignored with bf16 weights.

    The Triton path takes bf16/fp16 x with weights in x's dtype or e4m3 + scales; other dtype
    mixes (float32 x, say) run the reference on any device. `use_triton` forces the choice.
    """
    triton_ok = x.dtype in (torch.bfloat16, torch.float16) and (
        w13.dtype == FP8 if w13_scale is not None else w13.dtype == x.dtype
    )
    if use_triton and not triton_ok:
        raise ValueError(f"no Triton MoE for x {x.dtype} with weights {w13.dtype}")
    if triton_ok and _use_triton(x, use_triton):
        return fused_moe_triton(
            x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, config, shared_out, x_act, shared
        )
    if shared is not None:
        assert shared_out is None, "give the shared experts as shared_out or as shared, not both"
        shared_out = shared.mlp(x, x_act)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, shared_out, x_act)


__all__ = [
    "MoeConfig",
    "MoeDecodeConfig",
    "SharedExperts",
    "dequantize_blocks",
    "fused_moe",
    "fused_moe_ref",
    "fused_moe_triton",
    "moe_align",
    "pick_moe_config",
]
