"""What the decode GEMVs of fused MoE share: device functions and the weights' argument layout.

Used by the per-expert GEMVs (decode.py: which expert and rows a program takes, one K step of the
CUDA-core product) and by GEMM2 per token (decode_sum.py: the K step). A program of a per-expert
launch is a work item: items [0, P) are routed pairs p = t * top_k + j (the work of their expert,
done by its first pair, its "leader"), items P + c the shared chunk c (shared.py).
CUDA-core K step: SUB 128-column blocks, the activations [R, SUB, 128] in float32 (as stored, e4m3
times its scale, or quantized here as quantize_act_ref does) times a weight tile [.., BN, SUB, 128]
dequantized by one scale per 128-block.
"""

from __future__ import annotations

import torch

from mlac.kernels.fp8_quant import jit, round_e4m3, tl
from mlac.kernels.moe.shared import SharedExperts, shared_view


@jit
def _expert_of(ids_ptr, pair0, P, E, PAIRS: tl.constexpr):
    """(pair0's expert, how many pairs it has): the count is 0 where pair0 is not its expert's first
    pair or the expert is not in [0, E)."""
    offs = tl.arange(0, PAIRS)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)  # [PAIRS]
    expert = tl.load(ids_ptr + pair0)
    mine = (ids == expert) & (expert >= 0) & (expert < E)  # [PAIRS]
    earlier = tl.sum((mine & (offs < pair0)).to(tl.int32), axis=0)
    count = tl.sum(mine.to(tl.int32), axis=0)
    return expert, tl.where(earlier == 0, count, 0)


@jit
def pairs_of(ids_ptr, expert, P, r0, ROWS: tl.constexpr, PAIRS: tl.constexpr):
    """[ROWS] pairs of `expert` ranked r0 .. r0 + ROWS - 1 in pair order (0 past its last pair).
    Recomputed per chunk of rows so that no [PAIRS] vector stays live across the K loop."""
    offs = tl.arange(0, PAIRS)
    mine = tl.load(ids_ptr + offs, mask=offs < P, other=-1) == expert  # [PAIRS]
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1  # [PAIRS]
    sel = mine[None, :] & (rank[None, :] == (r0 + tl.arange(0, ROWS))[:, None])  # [ROWS, PAIRS]
    return tl.sum(tl.where(sel, offs[None, :], 0), axis=1)


@jit
def work_item(item, ids_ptr, P, T, N, E, b_ptr, bs_ptr, sb_ptr, sbs_ptr, stride_be, stride_bn, stride_bse,
              stride_bsn, stride_sbe, stride_sbn, stride_sbse, stride_sbsn, N_SHARED: tl.constexpr,
              PAIRS: tl.constexpr):  # fmt: skip
    """What program `item` of a GEMM1/GEMM2 launch computes: items [0, P) are routed pairs (the work of
    their expert, done by its first pair), items P + c the shared chunk c. -> (expert, rows (0 where
    a pair is not its expert's first, T for a chunk), weight base, scale base, weight row stride,
    scale row stride, first up row (GATED: N for an expert, S = N_SHARED * N for a chunk))."""
    shared = item >= P
    expert, count = _expert_of(ids_ptr, tl.minimum(item, P - 1), P, E, PAIRS)
    count = tl.where(shared, T, count)
    e64 = expert.to(tl.int64)
    chunk = (item - P).to(tl.int64)
    w = tl.where(shared, sb_ptr + chunk * stride_sbe, b_ptr + e64 * stride_be)
    ws = tl.where(shared, sbs_ptr + chunk * stride_sbse, bs_ptr + e64 * stride_bse)
    stride_n = tl.where(shared, stride_sbn, stride_bn).to(tl.int64)
    stride_sn = tl.where(shared, stride_sbsn, stride_bsn).to(tl.int64)
    up = tl.where(shared, N_SHARED * N, N)
    return expert, count, w, ws, stride_n, stride_sn, up


@jit
def rows_of(pair, r, item, P, T, A_ROW_DIV, GATED: tl.constexpr):
    """(rows of c, rows of a) of a pass: a routed pair p writes row p and reads a[p // A_ROW_DIV];
    rank r of shared chunk c = item - P writes row P + c * T + r and reads token r (GATED: x) or
    its own row (GEMM2: h)."""
    shared = item >= P
    c_shared = P + (item - P) * T + r
    if GATED:
        a_shared = r
    else:
        a_shared = c_shared
    c_row = tl.where(shared, c_shared, pair)
    return c_row.to(tl.int64), tl.where(shared, a_shared, pair // A_ROW_DIV).to(tl.int64)


@jit
def k_step(k0, K, SUB: tl.constexpr):
    """Columns of one K step: (k [SUB, 128], k_ok [SUB, 128], kb [SUB] their 128-blocks, kb_ok [SUB])."""
    kb = k0 // 128 + tl.arange(0, SUB)  # [SUB]
    k = kb[:, None] * 128 + tl.arange(0, 128)[None, :]  # [SUB, 128]
    return k, k < K, kb, kb * 128 < K


@jit
def load_a(a_ptr, as_ptr, a_row, row_ok, k, k_ok, kb, kb_ok, stride_am, stride_asm,
           A_MODE: tl.constexpr, FP8_MAX_C: tl.constexpr):  # fmt: skip
    """[R, SUB, 128] activations of rows a_row [R] at columns k [SUB, 128], as float32: A_MODE 0 as
    stored; 1 e4m3 times its scale (as_ptr [rows, ceil(K/128)]); 2 quantized here per 128 columns
    with quantize_act_ref's arithmetic (IEEE division, ties-to-even e4m3)."""
    mask = row_ok[:, None, None] & k_ok[None, :, :]
    a = tl.load(a_ptr + a_row[:, None, None] * stride_am + k[None, :, :], mask=mask, other=0.0).to(tl.float32)
    if A_MODE == 1:
        s_mask = row_ok[:, None] & kb_ok[None, :]
        a_s = tl.load(as_ptr + a_row[:, None] * stride_asm + kb[None, :], mask=s_mask, other=0.0)  # [R, SUB]
        a = a * a_s[:, :, None]
    elif A_MODE == 2:
        a_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(a), axis=2), 1e-12), FP8_MAX_C)  # [R, SUB]
        q = round_e4m3(tl.clamp(tl.math.div_rn(a, a_s[:, :, None]), -FP8_MAX_C, FP8_MAX_C))
        a = q * a_s[:, :, None]
    return a


@jit
def load_scales(ptrs, mask, FP8_W: tl.constexpr):
    """The weight's block scales at ptrs (FP8_W), else 1.0 (unused)."""
    scale = tl.full(mask.shape, 1.0, tl.float32)
    if FP8_W:
        scale = tl.load(ptrs, mask=mask, other=0.0)
    return scale


@jit
def slice_dot(a, b, b_scale, FP8_W: tl.constexpr):
    """sum_k a * dequant(b) over one K step: a [R or 1, 1 or J, SUB, 128] float32, b [1 or J, BN, SUB, 128]
    (either may broadcast), b_scale [.., BN, SUB] (FP8_W: one per 128-block) -> [R or J, BN] float32."""
    part = tl.sum(a * b.to(tl.float32), axis=3)  # [., BN, SUB]
    if FP8_W:
        part = part * b_scale
    return tl.sum(part, axis=2)


def expert_args(w: torch.Tensor, w_s: torch.Tensor | None) -> tuple:
    """(w, scales, their expert and row strides) as the kernels take them; w stands in for absent
    scales (bf16 weights: never read)."""
    w_s = w if w_s is None else w_s
    return w, w_s, w.stride(0), w.stride(1), w_s.stride(0), w_s.stride(1)


def shared_args(shared: SharedExperts | None, gated: bool, i: int, w: torch.Tensor, w_s) -> tuple:
    """`expert_args` of the shared chunks stacked like experts (`shared_view`), or of the routed
    experts again where there are none (never read: no program takes a shared item)."""
    return expert_args(*(shared_view(shared, gated, i) if shared is not None else (w, w_s)))
