"""Fused MoE at decode: the routed experts' GEMMs when each expert gets a few rows (GEMV on CUDA cores).

At decode (batch 1: 6 pairs over 64 experts) the grouped GEMMs of `moe.py` pad every expert to a
16-row tensor-core tile holding one real row, and their few tiles need split-K (lock counters) to
fill the GPU. Here each program streams a [BLOCK_N, K] slice of one expert's weight and multiplies
it by the few rows routed to that expert on CUDA cores, so the grid is (pairs, N / BLOCK_N): enough
programs to fill the SMs with no split of K, no tile padding, no `moe_align` and (FP8) no separate
activation quantization. Results are deterministic (no atomics, fixed summation order).

A program is indexed by a pair p = t * top_k + j; only the first pair of each expert (its
"leader") works, and it takes every pair of that expert, ROWS at a time; the others return at once.
Expert weights are read once per launch (per ROWS rows of the expert).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mlac.fp8 import BLOCK, FP8, FP8_MAX
from mlac.kernels.fp8_quant import Fp8Act, cast_out, jit, quant_groups, round_bf16, tl, triton

MAX_PAIRS = 256  # token-expert pairs a decode launch takes (PAIRS constexpr: 16..256, powers of two)
# A/B switch, read once: MLAC_MOE_DECODE_KERNEL=0 sends decode shapes to the grouped GEMMs of moe.py.
ENABLED = os.environ.get("MLAC_MOE_DECODE_KERNEL", "1") != "0"


@dataclass(frozen=True)
class MoeDecodeConfig:
    """Tiles of the decode GEMVs. With FP8 weights block_k must be 128 (one scale block)."""

    block_n1: int = 32  # GEMM1 columns of each half (gate, up) per program
    block_n2: int = 32  # GEMM2 output columns per program
    block_k: int = 128
    rows: int = 2  # an expert's rows taken per pass over its weight slice (power of two)
    num_warps: int = 4
    num_stages: int = 2


def pick_moe_decode_config(num_pairs: int, num_experts: int, fp8: bool) -> MoeDecodeConfig | None:
    """The decode kernel's tiles, or None where the grouped GEMMs of `moe.py` should run: more than
    MAX_PAIRS pairs, or more than 4 rows per expert on average (a weight slice is then re-read for
    every `rows` rows, and tensor cores pay off). Off when MLAC_MOE_DECODE_KERNEL=0."""
    if not ENABLED or num_pairs > MAX_PAIRS or num_pairs > 4 * num_experts:
        return None
    rows = 2 if num_pairs <= num_experts else 4
    return MoeDecodeConfig(32, 32, 128, rows, num_warps=4)


@jit
def _expert_rows(ids_ptr, pair0, P, E, PAIRS: tl.constexpr):
    """The pairs of pair0's expert: (expert, [PAIRS] mask of its pairs, [PAIRS] rank of each among
    them, count). count is 0 where pair0 is not its expert's first pair or its expert is not in [0, E)."""
    offs = tl.arange(0, PAIRS)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)  # [PAIRS]
    expert = tl.load(ids_ptr + pair0)
    mine = (ids == expert) & (expert >= 0) & (expert < E)  # [PAIRS]
    earlier = tl.sum((mine & (offs < pair0)).to(tl.int32), axis=0)
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1  # [PAIRS]
    count = tl.sum(mine.to(tl.int32), axis=0)
    count = tl.where(earlier == 0, count, 0)
    return expert, mine, rank, count


@jit
def _load_a(a_ptr, as_ptr, a_row, row_ok, k, k_ok, kb, stride_am, stride_asm,
            A_MODE: tl.constexpr, FP8_MAX_C: tl.constexpr):  # fmt: skip
    """[ROWS, BK] activations at columns k, as float32: A_MODE 0 as stored; 1 e4m3 times its scale
    (as_ptr [rows, ceil(K/128)]); 2 quantized here per 128 columns (quantize_act_ref's bits)."""
    mask = row_ok[:, None] & k_ok[None, :]
    a = tl.load(a_ptr + a_row[:, None] * stride_am + k[None, :], mask=mask, other=0.0).to(tl.float32)
    if A_MODE == 1:
        a_s = tl.load(as_ptr + a_row * stride_asm + kb, mask=row_ok, other=0.0)  # [ROWS]
        a = a * a_s[:, None]
    elif A_MODE == 2:
        q, a_s = quant_groups(a, FP8_MAX_C)
        a = q * a_s[:, None]
    return a


@jit
def _slice_dot(a, b_ptrs, bs_ptrs, n_ok, k_ok, kb, FP8_W: tl.constexpr):
    """sum_k a[r, k] * dequant(b)[n, k] over one K block: a [ROWS, BK] float32, b_ptrs [BN, BK]
    (bs_ptrs [BN]: the rows' scale rows, FP8_W) -> [ROWS, BN] float32."""
    b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BN, BK]
    part = tl.sum(a[:, None, :] * b[None, :, :], axis=2)  # [ROWS, BN]
    if FP8_W:
        part = part * tl.load(bs_ptrs + kb, mask=n_ok, other=0.0)[None, :]
    return part


@jit
def _silu_mul(gate, up, ROUND_BF16: tl.constexpr):
    """silu(gate) * up with the reference's roundings to bf16 (else fp16), in float32."""
    if ROUND_BF16:
        gate = round_bf16(gate)
        up = round_bf16(up)
        return round_bf16(round_bf16(gate / (1.0 + tl.exp(-gate))) * up)
    gate = gate.to(tl.float16).to(tl.float32)
    up = up.to(tl.float16).to(tl.float32)
    h = ((gate / (1.0 + tl.exp(-gate))).to(tl.float16).to(tl.float32) * up).to(tl.float16)
    return h.to(tl.float32)


@jit(dynamic=("P",))
def _moe_decode_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    ids_ptr,
    P,
    N,
    K,
    E,
    A_ROW_DIV,
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_cm,
    GATED: tl.constexpr,  # b rows [0, N) gate, [N, 2N) up: c = silu(gate) * up
    A_MODE: tl.constexpr,  # 0 a as stored; 1 a e4m3 + as [rows, ceil(K/128)]; 2 quantize a here
    FP8_W: tl.constexpr,  # b e4m3 + bs [E, ceil(rows/128), ceil(K/128)] (BLOCK_K == 128)
    ROUND_BF16: tl.constexpr,  # GATED: intermediates rounded like bf16 (else fp16)
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PAIRS: tl.constexpr,  # >= P, a power of two
    FP8_MAX_C: tl.constexpr,
):
    # c[p, n] = expert_{ids[p]} row n . a[p // A_ROW_DIV] for every pair p of this program's expert
    pair0 = tl.program_id(0)
    expert, mine, rank, count = _expert_rows(ids_ptr, pair0, P, E, PAIRS)
    if count == 0:
        return
    offs_p = tl.arange(0, PAIRS)
    offs_r = tl.arange(0, ROWS)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    b_rows = b_ptr + e64 * stride_be + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]  # [BN, BK]
    u_rows = b_rows + N * stride_bn  # up rows (GATED)
    bs_rows = bs_ptr + e64 * stride_bse + (offs_n // 128) * stride_bsn  # [BN] (FP8_W)
    us_rows = bs_ptr + e64 * stride_bse + ((N + offs_n) // 128) * stride_bsn
    for r0 in range(0, count, ROWS):
        sel = mine[None, :] & (rank[None, :] == (r0 + offs_r)[:, None])  # [ROWS, PAIRS]
        pair = tl.sum(tl.where(sel, offs_p[None, :], 0), axis=1)  # [ROWS]
        row_ok = r0 + offs_r < count
        a_row = (pair // A_ROW_DIV).to(tl.int64)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            kb = k0 // BLOCK_K
            a = _load_a(a_ptr, as_ptr, a_row, row_ok, k, k_ok, kb, stride_am, stride_asm, A_MODE, FP8_MAX_C)
            acc += _slice_dot(a, b_rows + k0, bs_rows, n_ok, k_ok, kb, FP8_W)
            if GATED:
                acc_u += _slice_dot(a, u_rows + k0, us_rows, n_ok, k_ok, kb, FP8_W)
        h = _silu_mul(acc, acc_u, ROUND_BF16) if GATED else acc
        c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, cast_out(h, c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _launch(a, a_s, w, w_s, c, ids, p, a_row_div, gated, a_mode, cfg: MoeDecodeConfig, block_n, round_bf16):
    """One decode GEMV launch: c [P, N] (N = w rows, halved when gated) from a and expert weights w."""
    e, rows, k = w.shape
    n = rows // 2 if gated else rows
    fp8_w = w_s is not None
    w_s = w if w_s is None else w_s  # unused without FP8 weights
    a_s = a if a_s is None else a_s
    _moe_decode_kernel[(p, triton.cdiv(n, block_n))](
        a, a_s, w, w_s, c, ids,
        p, n, k, e, a_row_div,
        a.stride(0), a_s.stride(0), w.stride(0), w.stride(1), w_s.stride(0), w_s.stride(1), c.stride(0),
        GATED=gated, A_MODE=a_mode, FP8_W=fp8_w, ROUND_BF16=round_bf16, ROWS=cfg.rows, BLOCK_N=block_n,
        BLOCK_K=cfg.block_k, PAIRS=max(16, triton.next_power_of_2(p)), FP8_MAX_C=FP8_MAX,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def moe_decode_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    x_act: Fp8Act | None,
    cfg: MoeDecodeConfig,
) -> torch.Tensor:
    """Each pair's expert output: y [T * top_k, D] in x's dtype, y[t * top_k + j] = expert_{ids[t, j]}(x[t])
    with fused_moe_ref's roundings (gate, up, silu(gate), h and y in x's dtype; with FP8 weights x
    and h quantized per token per 128 channels). Rows of pairs whose expert is outside [0, E) are
    not written. Two launches (GEMM1 + SiLU*up, GEMM2); arguments checked by `fused_moe_triton`;
    topk_ids contiguous, at most MAX_PAIRS pairs."""
    t, d = x.shape
    e, two_i, _ = w13.shape
    p = topk_ids.numel()
    assert 0 < p <= MAX_PAIRS and topk_ids.is_contiguous(), (p, MAX_PAIRS)
    assert cfg.rows & (cfg.rows - 1) == 0, f"rows must be a power of two: {cfg}"
    fp8 = w13_scale is not None
    if fp8:
        assert cfg.block_k == BLOCK, f"FP8 decode MoE needs 128-wide K blocks: {cfg}"
    round_bf16 = x.dtype == torch.bfloat16
    h = torch.empty(p, two_i // 2, dtype=x.dtype, device=x.device)
    if fp8 and x_act is not None:
        a, a_s, a_mode = x_act.q, x_act.scale, 1
        assert a.shape == x.shape and a.dtype == FP8 and a.stride(-1) == 1, (a.shape, a.dtype)
        assert a_s.shape == (t, triton.cdiv(d, BLOCK)) and a_s.dtype == torch.float32, a_s.shape
    else:
        a, a_s, a_mode = x, None, 2 if fp8 else 0
    _launch(
        a, a_s, w13, w13_scale, h, topk_ids, p, topk_ids.shape[1], True, a_mode, cfg, cfg.block_n1, round_bf16
    )
    y = torch.empty(p, d, dtype=x.dtype, device=x.device)
    _launch(h, None, w2, w2_scale, y, topk_ids, p, 1, False, 2 if fp8 else 0, cfg, cfg.block_n2, round_bf16)
    return y


__all__ = ["MAX_PAIRS", "MoeDecodeConfig", "moe_decode_experts", "pick_moe_decode_config"]
