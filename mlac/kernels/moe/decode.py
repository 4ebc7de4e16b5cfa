"""Fused MoE at decode, per expert: the routed experts' GEMM1 and GEMM2 when each gets a few rows.

    x   [T, D] (or its Fp8Act with FP8 weights) -> h [T * top_k + n * T, I]   (GEMM1: silu(gate) * up)
    h   [T * top_k + n * T, I]                  -> y [T * top_k + n * T, D]   (GEMM2)

Each program streams a [BLOCK_N, K] slice of one expert's weight against the few rows routed to
that expert, so the grid is (pairs, N / BLOCK_N): enough programs to fill the SMs with no split
of K, no `moe_align` and (FP8) no separate activation quantization. Results are deterministic (no
atomics, fixed summation order). A program is indexed by a pair p = t * top_k + j; only the first
pair of each expert (its "leader") works, and it takes every pair of that expert, ROWS (or 16) at a
time; the others return at once. A weight slice is read once per pass. Rows n * T past the pairs
are the shared chunks' (shared.py). Two forms of the product (MoeDecodeConfig.dot):

- CUDA cores (`_moe_decode_kernel`): the weight tile [1, BN, SUB, 128] times ROWS rows, float32.
- tensor cores, "swap AB" (`_moe_decode_dot_kernel`): W tile @ rows.T with the rows padded to 16,
  e4m3 MMA with FP8 weights; Triton pipelines the loads that feed tl.dot.

The top-k sum of y is reduce.py's, or GEMM2 per token sums it in its launch (decode_sum.py); when
this path runs and its tiles: decode_config.py; the reference: fused.py's fused_moe_ref.
"""

from __future__ import annotations

import torch

from mlac.core.fp8 import BLOCK, FP8, FP8_MAX
from mlac.kernels.fp8_quant import (
    Fp8Act,
    cast_out,
    interpreting,
    jit,
    pdl_launch,
    pdl_start,
    quant_groups,
    round_bf16,
    tl,
    triton,
)
from mlac.kernels.moe.decode_config import MAX_PAIRS, SMALL_PAIRS, MoeDecodeConfig, check_decode
from mlac.kernels.moe.decode_tiles import (
    expert_args,
    k_step,
    load_a,
    load_scales,
    pairs_of,
    rows_of,
    shared_args,
    slice_dot,
    work_item,
)
from mlac.kernels.moe.shared import SharedExperts


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


@jit(dynamic=("P", "T"))
def _moe_decode_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    sb_ptr,
    sbs_ptr,
    c_ptr,
    ids_ptr,
    P,
    T,
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
    stride_sbe,
    stride_sbn,
    stride_sbse,
    stride_sbsn,
    stride_cm,
    GATED: tl.constexpr,  # b rows [0, N) gate, [N, 2N) up: c = silu(gate) * up
    A_MODE: tl.constexpr,  # 0 a as stored; 1 a e4m3 + as [rows, ceil(K/128)]; 2 quantize a here
    FP8_W: tl.constexpr,  # b e4m3 + bs [E, ceil(rows/128), ceil(K/128)]
    ROUND_BF16: tl.constexpr,  # GATED: intermediates rounded like bf16 (else fp16)
    N_SHARED: tl.constexpr,  # shared chunks: sb [N_SHARED, N, K] (+ up rows S = N_SHARED * N further), sbs
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,  # 128-column blocks per K step
    PAIRS: tl.constexpr,  # >= P: SMALL_PAIRS or MAX_PAIRS
    FP8_MAX_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    # c[p, n] = expert_{ids[p]} row n . a[p // A_ROW_DIV] for every pair p of this program's expert;
    # programs P + c: c[P + c * T + t, n] = shared chunk c's row n . a[t (GATED) or P + c * T + t]
    item = tl.program_id(0)
    expert, count, w, ws, stride_n, stride_sn, up = work_item(
        item, ids_ptr, P, T, N, E, b_ptr, bs_ptr, sb_ptr, sbs_ptr, stride_be, stride_bn, stride_bse, stride_bsn,
        stride_sbe, stride_sbn, stride_sbse, stride_sbsn, N_SHARED, PAIRS,
    )  # fmt: skip
    if count == 0:
        return
    offs_r = tl.arange(0, ROWS)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    # [1, BN, 1, 1] row pointers: the weight tile is loaded as [1, BN, SUB, 128], the layout its
    # product with the activations [ROWS, 1, SUB, 128] keeps (no shuffle of the large operand)
    b_rows = (w + offs_n.to(tl.int64) * stride_n)[None, :, None, None]
    u_rows = (w + (up + offs_n).to(tl.int64) * stride_n)[None, :, None, None]  # up rows (GATED)
    bs_rows = (ws + (offs_n // 128) * stride_sn)[:, None]  # [BN, 1] (FP8_W)
    us_rows = (ws + ((up + offs_n) // 128) * stride_sn)[:, None]
    n_ok4 = n_ok[None, :, None, None]
    for r0 in range(0, count, ROWS):
        pair = pairs_of(ids_ptr, expert, P, r0, ROWS, PAIRS)  # [ROWS]
        row_ok = r0 + offs_r < count
        c_row, a_row = rows_of(pair, r0 + offs_r, item, P, T, A_ROW_DIV, GATED)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, SUB * 128):
            k, k_ok, kb, kb_ok = k_step(k0, K, SUB)
            a = load_a(
                a_ptr, as_ptr, a_row, row_ok, k, k_ok, kb, kb_ok, stride_am, stride_asm, A_MODE, FP8_MAX_C
            )
            a = a[:, None, :, :]  # [ROWS, 1, SUB, 128]
            b_mask = n_ok4 & k_ok[None, None, :, :]
            s_mask = n_ok[:, None] & kb_ok[None, :]
            b = tl.load(b_rows + k[None, None, :, :], mask=b_mask, other=0.0)  # [1, BN, SUB, 128]
            b_s = load_scales(bs_rows + kb[None, :], s_mask, FP8_W)  # [BN, SUB]
            acc += slice_dot(a, b, b_s, FP8_W)
            if GATED:
                u = tl.load(u_rows + k[None, None, :, :], mask=b_mask, other=0.0)
                acc_u += slice_dot(a, u, load_scales(us_rows + kb[None, :], s_mask, FP8_W), FP8_W)
        h = _silu_mul(acc, acc_u, ROUND_BF16) if GATED else acc
        c_ptrs = c_ptr + c_row[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, cast_out(h, c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@jit
def _dot_rows(a_ptr, as_ptr, a_row, row_ok, k, k_ok, kb, stride_am, stride_asm,
              A_MODE: tl.constexpr, FP8_MAX_C: tl.constexpr):  # fmt: skip
    """The dot operand of 16 rows at columns k [128]: (rows [16, BK] as stored (A_MODE 0) or e4m3
    (1: loaded, 2: quantized here as quantize_act_ref does), their scales [16] (1.0 for A_MODE 0))."""
    mask = row_ok[:, None] & k_ok[None, :]
    a = tl.load(a_ptr + a_row[:, None] * stride_am + k[None, :], mask=mask, other=0.0)
    a_s = tl.full(row_ok.shape, 1.0, tl.float32)
    if A_MODE == 1:
        a_s = tl.load(as_ptr + a_row * stride_asm + kb, mask=row_ok, other=0.0)
    elif A_MODE == 2:
        q, a_s = quant_groups(a.to(tl.float32), FP8_MAX_C)
        a = q.to(tl.float8e4nv)
    return a, a_s


@jit
def _dot_part(b, a, a_s, bs_ptrs, n_ok, FP8_W: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """Tensor cores: b [BN, BK] @ a.T [BK, 16] -> [BN, 16] float32, dequantized by the weight's
    row scales (bs_ptrs [BN]) and the rows' scales a_s [16] when FP8_W."""
    if UPCAST_DOT:  # interpreter only (see fp8_quant.interpreting)
        b = b.to(tl.float32)
        a = a.to(tl.float32)
    part = tl.dot(b, tl.trans(a))
    if FP8_W:
        part = part * (tl.load(bs_ptrs, mask=n_ok, other=0.0)[:, None] * a_s[None, :])
    return part


@jit(dynamic=("P", "T"))
def _moe_decode_dot_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    sb_ptr,
    sbs_ptr,
    c_ptr,
    ids_ptr,
    P,
    T,
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
    stride_sbe,
    stride_sbn,
    stride_sbse,
    stride_sbsn,
    stride_cm,
    GATED: tl.constexpr,
    A_MODE: tl.constexpr,
    FP8_W: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    N_SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # 128 with FP8 weights (one scale per step)
    PAIRS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    # _moe_decode_kernel's contract on tensor cores, "swap AB": the weight tile [BN, BK] is the
    # MMA's M side and the expert's rows (16 a pass, padded) its N side; loads that feed tl.dot are
    # pipelined by Triton (num_stages tiles in flight), which the CUDA-core loop's are not.
    item = tl.program_id(0)
    expert, count, w, ws, stride_n, stride_sn, up = work_item(
        item, ids_ptr, P, T, N, E, b_ptr, bs_ptr, sb_ptr, sbs_ptr, stride_be, stride_bn, stride_bse, stride_bsn,
        stride_sbe, stride_sbn, stride_sbse, stride_sbsn, N_SHARED, PAIRS,
    )  # fmt: skip
    if count == 0:
        return
    offs_r = tl.arange(0, 16)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    b_rows = w + offs_n.to(tl.int64)[:, None] * stride_n + offs_k[None, :]  # [BN, BK]
    u_rows = w + (up + offs_n).to(tl.int64)[:, None] * stride_n + offs_k[None, :]  # up rows (GATED)
    bs_rows = ws + (offs_n // 128) * stride_sn  # [BN] (FP8_W)
    us_rows = ws + ((up + offs_n) // 128) * stride_sn
    for r0 in range(0, count, 16):
        pair = pairs_of(ids_ptr, expert, P, r0, 16, PAIRS)  # [16]
        row_ok = r0 + offs_r < count
        c_row, a_row = rows_of(pair, r0 + offs_r, item, P, T, A_ROW_DIV, GATED)
        acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)  # c.T tile
        acc_u = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            kb = k0 // 128
            a, a_s = _dot_rows(
                a_ptr, as_ptr, a_row, row_ok, k, k_ok, kb, stride_am, stride_asm, A_MODE, FP8_MAX_C
            )
            b_mask = n_ok[:, None] & k_ok[None, :]
            b = tl.load(b_rows + k0, mask=b_mask, other=0.0)
            acc += _dot_part(b, a, a_s, bs_rows + kb, n_ok, FP8_W, UPCAST_DOT)
            if GATED:
                u = tl.load(u_rows + k0, mask=b_mask, other=0.0)
                acc_u += _dot_part(u, a, a_s, us_rows + kb, n_ok, FP8_W, UPCAST_DOT)
        h = _silu_mul(acc, acc_u, ROUND_BF16) if GATED else acc  # [BN, 16]
        c_ptrs = c_ptr + c_row[None, :] * stride_cm + offs_n[:, None]
        tl.store(c_ptrs, cast_out(h, c_ptr.dtype.element_ty), mask=n_ok[:, None] & row_ok[None, :])


def _launch(a, a_s, w, w_s, c, ids, p, a_row_div, gated, a_mode, cfg: MoeDecodeConfig, block_n, round_bf16,
            shared: SharedExperts | None, t: int):  # fmt: skip
    """One decode GEMV launch: c [P + n * T, N] (N = w rows, halved when gated) from a and expert
    weights w, the n shared chunks in rows P + c * T + t."""
    e, rows, k = w.shape
    n = rows // 2 if gated else rows
    n_shared = 0 if shared is None else shared.w2.shape[-1] // (n if gated else k)
    fp8_w = w_s is not None
    a_s = a if a_s is None else a_s
    b, b_s, stride_be, stride_bn, stride_bse, stride_bsn = expert_args(w, w_s)
    sb, sb_s, *shared_strides = shared_args(shared, gated, n if gated else k, w, w_s)
    args = (
        a, a_s, b, b_s, sb, sb_s, c, ids,
        p, t, n, k, e, a_row_div,
        a.stride(0), a_s.stride(0), stride_be, stride_bn, stride_bse, stride_bsn, *shared_strides, c.stride(0),
    )  # fmt: skip
    common = dict(
        GATED=gated, A_MODE=a_mode, FP8_W=fp8_w, ROUND_BF16=round_bf16, N_SHARED=n_shared, BLOCK_N=block_n,
        PAIRS=SMALL_PAIRS if p <= SMALL_PAIRS else MAX_PAIRS, FP8_MAX_C=FP8_MAX,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    grid = (p + n_shared, triton.cdiv(n, block_n))
    if cfg.dot:
        block_k = BLOCK if fp8_w else cfg.block_k
        _moe_decode_dot_kernel[grid](
            *args, BLOCK_K=block_k, UPCAST_DOT=interpreting(), **common, **pdl_launch()
        )
    else:
        _moe_decode_kernel[grid](*args, ROWS=cfg.rows, SUB=cfg.block_k // BLOCK, **common, **pdl_launch())


def moe_decode_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    x_act: Fp8Act | None,
    cfg: MoeDecodeConfig,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """GEMM1: h [T * top_k + n * T, I] in x's dtype, h[t * top_k + j] = silu(gate) * up of expert
    ids[t, j] on x[t], with fused_moe_ref's roundings (with FP8 weights x is quantized per token per
    128 channels, here or by its producer: x_act); with `shared` (n = shared_chunks(...) > 0, checked
    by the caller), h[T * top_k + c * T + t] the same of shared chunk c on x[t]. Rows of pairs whose
    expert is outside [0, E) are not written. Arguments checked by `fused_moe_triton`; topk_ids
    contiguous, at most MAX_PAIRS pairs."""
    t, d = x.shape
    p = topk_ids.numel()
    i = w13.shape[1] // 2
    check_decode(p, topk_ids, cfg)
    n_shared = 0 if shared is None else shared.w2.shape[-1] // i
    h = torch.empty(p + n_shared * t, i, dtype=x.dtype, device=x.device)
    if w13_scale is not None and x_act is not None:
        a, a_s, a_mode = x_act.q, x_act.scale, 1
        assert a.shape == x.shape and a.dtype == FP8 and a.stride(-1) == 1, (a.shape, a.dtype)
        assert a_s.shape == (t, triton.cdiv(d, BLOCK)) and a_s.dtype == torch.float32, a_s.shape
    else:
        a, a_s, a_mode = x, None, 2 if w13_scale is not None else 0
    round_bf16 = x.dtype == torch.bfloat16
    top_k = topk_ids.shape[1]
    _launch(
        a, a_s, w13, w13_scale, h, topk_ids, p, top_k, True, a_mode, cfg, cfg.block_n1, round_bf16, shared, t
    )
    return h


def moe_decode_down(
    h: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    w2_scale: torch.Tensor | None,
    cfg: MoeDecodeConfig,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """GEMM2 per expert: y [T * top_k + n * T, D] in h's dtype, y[p] = expert_{ids[p]}'s w2 on h[p]
    (h quantized per 128 channels with FP8 weights), and with `shared` the rows of the n shared
    chunks as `moe_decode_gate_up` lays them out, for the top-k reduce (reduce.py). Rows of pairs
    whose expert is outside [0, E) are not written."""
    p = topk_ids.numel()
    t = topk_ids.shape[0]
    check_decode(p, topk_ids, cfg)
    y = torch.empty(h.shape[0], w2.shape[1], dtype=h.dtype, device=h.device)
    mode = 2 if w2_scale is not None else 0
    _launch(h, None, w2, w2_scale, y, topk_ids, p, 1, False, mode, cfg, cfg.block_n2, True, shared, t)
    return y
