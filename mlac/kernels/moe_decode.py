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
    fuse_sum: bool = False  # GEMM2 per token: all top_k experts' slices and the weighted sum in one launch


def pick_moe_decode_config(num_pairs: int, num_experts: int, fp8: bool) -> MoeDecodeConfig | None:
    """The decode kernel's tiles, or None where the grouped GEMMs of `moe.py` should run: more than
    MAX_PAIRS pairs, or more than 4 rows per expert on average (a weight slice is then re-read for
    every `rows` rows, and tensor cores pay off). Off when MLAC_MOE_DECODE_KERNEL=0. With about
    one row per expert GEMM2 runs per token and sums the top-k (`fuse_sum`): one launch fewer, and
    an expert shared by several tokens is re-read (from L2: the tokens' programs of one N block
    run together)."""
    if not ENABLED or num_pairs > MAX_PAIRS or num_pairs > 4 * num_experts:
        return None
    if num_pairs <= num_experts:  # about one row per expert: GEMM2 per token, summed in its launch
        return MoeDecodeConfig(32, 16, 128, 2, num_warps=8, fuse_sum=True)
    return MoeDecodeConfig(32, 32, 128, 4, num_warps=4)


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


@jit(dynamic=("T",))
def _moe_decode_down_sum_kernel(
    h_ptr,
    b_ptr,
    bs_ptr,
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
    stride_out,
    stride_shared,
    TOP_K: tl.constexpr,
    KPAD: tl.constexpr,  # TOP_K rounded up to a power of two
    A_MODE: tl.constexpr,  # 0 h as stored; 2 quantize h here (FP8 weights)
    FP8_W: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
):
    # out[t, n] = sum_j tw[t, j] * round(w2_{ids[t, j]} row n . h[t * TOP_K + j]) (+ shared[t, n]),
    # in float32 over the pairs whose expert is in [0, E), rounded once; one program per (t, N block)
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    offs_j = tl.arange(0, KPAD)
    pair = t * TOP_K + offs_j  # [KPAD]
    expert = tl.load(ids_ptr + pair, mask=offs_j < TOP_K, other=-1)
    ok = (offs_j < TOP_K) & (expert >= 0) & (expert < E)  # [KPAD]
    e64 = tl.where(ok, expert, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    rows = e64[:, None] * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn  # [KPAD, BN]
    b_ptrs = b_ptr + rows[:, :, None] + offs_k[None, None, :]  # [KPAD, BN, BK]
    bs_ptrs = bs_ptr + e64[:, None] * stride_bse + (offs_n // 128)[None, :] * stride_bsn  # [KPAD, BN]
    jn_ok = ok[:, None] & n_ok[None, :]
    acc = tl.zeros((KPAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        kb = k0 // BLOCK_K
        a = _load_a(h_ptr, h_ptr, pair, ok, k, k_ok, kb, stride_hm, 0, A_MODE, FP8_MAX_C)  # [KPAD, BK]
        b = tl.load(b_ptrs + k0, mask=jn_ok[:, :, None] & k_ok[None, None, :], other=0.0).to(tl.float32)
        part = tl.sum(a[:, None, :] * b, axis=2)  # [KPAD, BN]
        if FP8_W:
            part = part * tl.load(bs_ptrs + kb, mask=jn_ok, other=0.0)
        acc += part
    if out_ptr.dtype.element_ty == tl.bfloat16:  # each expert's output rounded as the reference's
        y = round_bf16(acc)
    else:
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    tw = tl.load(tw_ptr + pair, mask=ok, other=0.0).to(tl.float32)  # [KPAD]
    total = tl.sum(tl.where(jn_ok, y * tw[:, None], 0.0), axis=0)  # [BN]
    if HAS_SHARED:
        total += tl.load(shared_ptr + t * stride_shared + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs_n, cast_out(total, out_ptr.dtype.element_ty), mask=n_ok)


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


def moe_decode_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    x_act: Fp8Act | None,
    cfg: MoeDecodeConfig,
) -> torch.Tensor:
    """GEMM1: h [T * top_k, I] in x's dtype, h[t * top_k + j] = silu(gate) * up of expert ids[t, j]
    on x[t], with fused_moe_ref's roundings (with FP8 weights x is quantized per token per 128
    channels, here or by its producer: x_act). Rows of pairs whose expert is outside [0, E) are not
    written. Arguments checked by `fused_moe_triton`; topk_ids contiguous, at most MAX_PAIRS pairs."""
    t, d = x.shape
    p = topk_ids.numel()
    _check_decode(p, topk_ids, cfg, w13_scale is not None)
    h = torch.empty(p, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    if w13_scale is not None and x_act is not None:
        a, a_s, a_mode = x_act.q, x_act.scale, 1
        assert a.shape == x.shape and a.dtype == FP8 and a.stride(-1) == 1, (a.shape, a.dtype)
        assert a_s.shape == (t, triton.cdiv(d, BLOCK)) and a_s.dtype == torch.float32, a_s.shape
    else:
        a, a_s, a_mode = x, None, 2 if w13_scale is not None else 0
    round_bf16 = x.dtype == torch.bfloat16
    _launch(
        a, a_s, w13, w13_scale, h, topk_ids, p, topk_ids.shape[1], True, a_mode, cfg, cfg.block_n1, round_bf16
    )
    return h


def moe_decode_down(
    h: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    w2_scale: torch.Tensor | None,
    cfg: MoeDecodeConfig,
) -> torch.Tensor:
    """GEMM2 per expert: y [T * top_k, D] in h's dtype, y[p] = expert_{ids[p]}'s w2 on h[p] (h
    quantized per 128 channels with FP8 weights), for the top-k reduce of moe.py. Rows of pairs
    whose expert is outside [0, E) are not written."""
    p = topk_ids.numel()
    _check_decode(p, topk_ids, cfg, w2_scale is not None)
    y = torch.empty(p, w2.shape[1], dtype=h.dtype, device=h.device)
    mode = 2 if w2_scale is not None else 0
    _launch(h, None, w2, w2_scale, y, topk_ids, p, 1, False, mode, cfg, cfg.block_n2, True)
    return y


def moe_decode_down_sum(
    h: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w2_scale: torch.Tensor | None,
    shared_out: torch.Tensor | None,
    out: torch.Tensor,
    cfg: MoeDecodeConfig,
) -> torch.Tensor:
    """GEMM2 per token with the top-k sum: out [T, D] = sum_j topk_weights[t, j] * y[t * top_k + j]
    over the pairs whose expert is in [0, E) (y rounded to out's dtype as in fused_moe_ref), plus
    shared_out, summed in float32 and rounded once. Deterministic. Returns out."""
    t, d = out.shape
    e, _, i = w2.shape
    top_k = topk_ids.shape[1]
    fp8 = w2_scale is not None
    _check_decode(topk_ids.numel(), topk_ids, cfg, fp8)
    w_s = w2 if w2_scale is None else w2_scale  # unused without FP8 weights
    shared = out if shared_out is None else shared_out  # unused without shared_out
    _moe_decode_down_sum_kernel[(t, triton.cdiv(d, cfg.block_n2))](
        h, w2, w_s, topk_ids, topk_weights.contiguous(), out, shared,
        t, d, i, e,
        h.stride(0), w2.stride(0), w2.stride(1), w_s.stride(0), w_s.stride(1), out.stride(0), shared.stride(0),
        TOP_K=top_k, KPAD=triton.next_power_of_2(top_k), A_MODE=2 if fp8 else 0, FP8_W=fp8,
        HAS_SHARED=shared_out is not None, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k, FP8_MAX_C=FP8_MAX,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _check_decode(p: int, topk_ids: torch.Tensor, cfg: MoeDecodeConfig, fp8: bool) -> None:
    assert 0 < p <= MAX_PAIRS and topk_ids.is_contiguous(), (p, MAX_PAIRS)
    assert cfg.rows & (cfg.rows - 1) == 0, f"rows must be a power of two: {cfg}"
    assert not fp8 or cfg.block_k == BLOCK, f"FP8 decode MoE needs 128-wide K blocks: {cfg}"


__all__ = [
    "MAX_PAIRS",
    "MoeDecodeConfig",
    "moe_decode_down",
    "moe_decode_down_sum",
    "moe_decode_gate_up",
    "pick_moe_decode_config",
]
