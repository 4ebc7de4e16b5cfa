"""Skinny dense GEMM for decode (M <= 16 rows): y [M, N] = x [M, K] @ W [N, K].T, bf16/fp16 or
block-FP8 weights.

At M <= 16 these products are bound by streaming W, not by arithmetic: each program reads a
[BLOCK_N, BLOCK_K] tile of W per step (row-major, K contiguous) and multiplies it by the M
activation rows, either on CUDA cores (one row at a time, `dot=False`) or as one tensor-core
product W_tile @ x.T with the M rows padded to 16 (`dot=True`, "swap AB": N fills the MMA's
M side). Split-K, when N gives too few programs, reduces in the same launch: the last program of
each N tile to arrive sums the float32 partials in split order (fp8_gemm's lock counters).

FP8 weights (e4m3 + float32 128x128 block scales) take an `Fp8Act` (quantized by its producer) or
a float x, which the kernel quantizes per (row, 128 channels) exactly as `quantize_act_ref`:
the numerics are `fp8_linear_ref`'s up to summation order. bf16/fp16 weights take x of the same
dtype and accumulate in float32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mlac.core.fp8 import BLOCK, FP8, FP8_MAX
from mlac.kernels._triton import pdl_launch, pdl_start
from mlac.kernels.fp8_quant import HAS_TRITON, Fp8Act, cast_out, jit, quant_groups, round_e4m3, tl, triton
from mlac.kernels.gemm.fp8_gemm import fp8_act_linear_ref, fp8_linear_ref, sm_count, split_k_locks

MAX_ROWS = 16  # the largest M this kernel takes (the tensor-core form pads M to this)
M_CLASSES = (1, 4, MAX_ROWS)  # tuned configs are keyed by the smallest class >= M
DENSE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SkinnyConfig:
    """Tile and launch options. FP8 weights need block_k == 128 and block_n dividing 128 (one
    weight scale per tile and K step); `dot` needs block_n, block_k >= 16."""

    block_n: int
    block_k: int
    split_k: int = 1  # K ranges reduced in-launch by the last program of each N tile
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False  # tensor-core W_tile @ x.T (M padded to 16) instead of CUDA-core rows


# Measured configs, keyed by (kind, N, K, m_class): kind "bf16" (also fp16) or "fp8", m_class
# from M_CLASSES; None where the path the skinny GEMM replaces (cuBLAS, fp8_gemm) measured faster
# (skinny_applies then declines). bf16 shapes not here use default_config. From
# benchmarks/bench_gemv.py on one H200 (benchmarks/results/gemv_h200.json): a config is kept where it
# beat the baseline by >= 3% summed over the class's M; the comment gives the mean time per call,
# skinny vs baseline. FP8: None throughout, and an FP8 shape not here does not take it either
# (skinny_applies). Alone the skinny GEMM won most FP8 shapes by 3-20%, but inside the V2-Lite decode
# step fp8_gemm on the norm's Fp8Act was faster (batch 1: 330.7 against 317.3 tok/s, batch 32 equal;
# MLAC_SKINNY_GEMM=0 A/B in benchmarks/results/ab_pdl_skinny_h200_run.txt).
_C = SkinnyConfig  # (block_n, block_k, split_k, num_warps, num_stages, dot)
TUNED: dict[tuple[str, int, int, int], SkinnyConfig | None] = {
    ("bf16", 576, 2048, 1): _C(16, 256, 8, 4, 4, False),  # M=1: 4.36 us vs 6.05
    ("bf16", 576, 2048, 4): _C(64, 256, 8, 4, 3, True),  # M=2,4: 4.67 us vs 5.83
    ("bf16", 576, 2048, 16): _C(64, 256, 8, 4, 3, True),  # M=8,16: 5.06 us vs 5.79
    ("bf16", 576, 7168, 1): _C(16, 256, 8, 4, 4, False),  # M=1: 6.16 us vs 6.90
    ("bf16", 576, 7168, 4): _C(64, 256, 8, 4, 3, True),  # M=2,4: 6.70 us vs 7.01
    ("bf16", 576, 7168, 16): _C(32, 128, 16, 4, 4, True),  # M=8,16: 6.60 us vs 7.18
    ("bf16", 1536, 7168, 1): _C(32, 256, 8, 4, 4, False),  # M=1: 9.24 us vs 9.82
    ("bf16", 1536, 7168, 4): _C(32, 128, 8, 4, 4, True),  # M=2,4: 9.58 us vs 9.87
    ("bf16", 1536, 7168, 16): None,  # M=8,16: cublas 9.93 us, skinny 9.73
    ("bf16", 2048, 1408, 1): _C(16, 512, 1, 4, 4, False),  # M=1: 4.31 us vs 5.16
    ("bf16", 2048, 1408, 4): None,  # M=2,4: cublas 5.18 us, skinny 5.40
    ("bf16", 2048, 1408, 16): None,  # M=8,16: cublas 5.19 us, skinny 5.56
    ("bf16", 2048, 2048, 1): None,  # M=1: cublas 6.07 us, skinny 5.90
    ("bf16", 2048, 2048, 4): None,  # M=2,4: cublas 6.06 us, skinny 6.00
    ("bf16", 2048, 2048, 16): None,  # M=8,16: cublas 6.08 us, skinny 6.19
    ("bf16", 2048, 10944, 1): _C(32, 128, 8, 4, 4, True),  # M=1: 15.32 us vs 15.89
    ("bf16", 2048, 10944, 4): None,  # M=2,4: cublas 15.78 us, skinny 15.51
    ("bf16", 2048, 10944, 16): None,  # M=8,16: cublas 15.84 us, skinny 15.88
    ("bf16", 2816, 2048, 1): None,  # M=1: cublas 6.25 us, skinny 6.76
    ("bf16", 2816, 2048, 4): None,  # M=2,4: cublas 6.23 us, skinny 7.03
    ("bf16", 2816, 2048, 16): None,  # M=8,16: cublas 6.26 us, skinny 7.11
    ("bf16", 3072, 2048, 1): None,  # M=1: cublas 6.10 us, skinny 6.72
    ("bf16", 3072, 2048, 4): None,  # M=2,4: cublas 6.41 us, skinny 7.17
    ("bf16", 3072, 2048, 16): None,  # M=8,16: cublas 6.43 us, skinny 7.36
    ("bf16", 4096, 7168, 1): _C(32, 128, 4, 4, 4, True),  # M=1: 18.04 us vs 19.07
    ("bf16", 4096, 7168, 4): _C(32, 128, 4, 4, 4, True),  # M=2,4: 18.28 us vs 19.15
    ("bf16", 4096, 7168, 16): _C(32, 128, 4, 4, 4, True),  # M=8,16: 18.80 us vs 19.46
    ("bf16", 7168, 2048, 1): None,  # M=1: cublas 10.17 us, skinny 11.13
    ("bf16", 7168, 2048, 4): None,  # M=2,4: cublas 10.01 us, skinny 11.22
    ("bf16", 7168, 2048, 16): None,  # M=8,16: cublas 9.95 us, skinny 11.54
    ("bf16", 7168, 16384, 1): None,  # M=1: cublas 59.38 us, skinny 58.32
    ("bf16", 7168, 16384, 4): None,  # M=2,4: cublas 60.18 us, skinny 58.70
    ("bf16", 7168, 16384, 16): _C(64, 128, 4, 4, 4, True),  # M=8,16: 59.80 us vs 64.92
    ("bf16", 21888, 2048, 1): None,  # M=1: cublas 24.26 us, skinny 23.98
    ("bf16", 21888, 2048, 4): None,  # M=2,4: cublas 24.74 us, skinny 24.84
    ("bf16", 21888, 2048, 16): None,  # M=8,16: cublas 24.88 us, skinny 25.21
    ("bf16", 24576, 1536, 1): _C(64, 128, 1, 4, 4, False),  # M=1: 20.56 us vs 21.58
    ("bf16", 24576, 1536, 4): _C(64, 128, 1, 4, 4, True),  # M=2,4: 20.91 us vs 21.77
    ("bf16", 24576, 1536, 16): None,  # M=8,16: cublas 21.55 us, skinny 21.35
    ("fp8", 576, 2048, 1): None,  # alone M=1: 4.25 us vs 5.02
    ("fp8", 576, 2048, 4): None,  # alone M=2,4: 4.43 us vs 5.08
    ("fp8", 576, 2048, 16): None,  # alone M=8,16: 4.62 us vs 5.27
    ("fp8", 576, 7168, 1): None,  # alone M=1: 5.79 us vs 6.68
    ("fp8", 576, 7168, 4): None,  # alone M=2,4: 5.86 us vs 6.83
    ("fp8", 576, 7168, 16): None,  # alone M=8,16: 6.06 us vs 7.14
    ("fp8", 1536, 7168, 1): None,  # alone M=1: 7.34 us vs 7.81
    ("fp8", 1536, 7168, 4): None,  # alone M=2,4: 7.45 us vs 7.93
    ("fp8", 1536, 7168, 16): None,  # alone M=8,16: 7.65 us vs 8.47
    ("fp8", 2048, 1408, 1): None,  # alone M=1: 4.75 us vs 5.89
    ("fp8", 2048, 1408, 4): None,  # alone M=2,4: 4.83 us vs 6.04
    ("fp8", 2048, 1408, 16): None,  # alone M=8,16: 4.99 us vs 6.38
    ("fp8", 2048, 2048, 1): None,  # alone M=1: 5.25 us vs 5.53
    ("fp8", 2048, 2048, 4): None,  # alone M=2,4: 5.33 us vs 5.61
    ("fp8", 2048, 2048, 16): None,  # M=8,16: fp8_gemm 5.77 us, skinny 5.80
    ("fp8", 2048, 10944, 1): None,  # alone M=1: 10.54 us vs 11.12
    ("fp8", 2048, 10944, 4): None,  # alone M=2,4: 10.92 us vs 11.29
    ("fp8", 2048, 10944, 16): None,  # alone M=8,16: 11.14 us vs 12.25
    ("fp8", 2816, 2048, 1): None,  # alone M=1: 5.85 us vs 6.07
    ("fp8", 2816, 2048, 4): None,  # alone M=2,4: 6.00 us vs 6.20
    ("fp8", 2816, 2048, 16): None,  # M=8,16: fp8_gemm 6.42 us, skinny 6.29
    ("fp8", 3072, 2048, 1): None,  # alone M=1: 5.94 us vs 6.15
    ("fp8", 3072, 2048, 4): None,  # M=2,4: fp8_gemm 6.25 us, skinny 6.12
    ("fp8", 3072, 2048, 16): None,  # M=8,16: fp8_gemm 6.49 us, skinny 6.42
    ("fp8", 4096, 7168, 1): None,  # M=1: fp8_gemm 11.55 us, skinny 11.25
    ("fp8", 4096, 7168, 4): None,  # M=2,4: fp8_gemm 11.66 us, skinny 11.40
    ("fp8", 4096, 7168, 16): None,  # M=8,16: fp8_gemm 12.27 us, skinny 12.24
    ("fp8", 7168, 2048, 1): None,  # alone M=1: 8.02 us vs 8.53
    ("fp8", 7168, 2048, 4): None,  # alone M=2,4: 8.18 us vs 8.69
    ("fp8", 7168, 2048, 16): None,  # alone M=8,16: 8.76 us vs 9.07
    ("fp8", 7168, 16384, 1): None,  # alone M=1: 31.81 us vs 32.97
    ("fp8", 7168, 16384, 4): None,  # alone M=2,4: 32.16 us vs 33.30
    ("fp8", 7168, 16384, 16): None,  # M=8,16: fp8_gemm 34.48 us, skinny 33.49
    ("fp8", 21888, 2048, 1): None,  # alone M=1: 13.34 us vs 14.33
    ("fp8", 21888, 2048, 4): None,  # alone M=2,4: 13.56 us vs 14.53
    ("fp8", 21888, 2048, 16): None,  # alone M=8,16: 13.94 us vs 14.73
    ("fp8", 24576, 1536, 1): None,  # alone M=1: 11.50 us vs 12.32
    ("fp8", 24576, 1536, 4): None,  # alone M=2,4: 11.58 us vs 12.30
    ("fp8", 24576, 1536, 16): None,  # alone M=8,16: 11.81 us vs 12.50
}


def m_class(m: int) -> int:
    """The smallest of M_CLASSES that is >= m (m <= MAX_ROWS)."""
    return next(c for c in M_CLASSES if c >= m)


def split_for(n_tiles: int, k_blocks: int, sms: int, min_blocks: int = 2) -> int:
    """Power-of-two split of K that brings the grid to about 2 programs per SM, keeping at least
    `min_blocks` K steps per split (1 when N alone fills the machine)."""
    split = 1
    while n_tiles * split < 2 * sms and k_blocks >= 2 * split * min_blocks:
        split *= 2
    return split


def default_config(kind: str, n: int, k: int, m: int, sms: int) -> SkinnyConfig:
    """A config by rule: CUDA cores up to 4 rows (each W element feeds <= 4 FMAs), tensor cores
    above; one row keeps a [BN, BK] float32 accumulator, 2-4 rows reduce each step (narrower
    tiles: registers); narrow N tiles for narrow N; split-K up to about 2 programs per SM."""
    dot = m > 4
    block_k = BLOCK if dot or kind == "fp8" else 2 * BLOCK
    block_n = 64 if dot else 32 if m == 1 else 16
    if n <= 1024:
        block_n = max(16, block_n // 2)
    split = split_for(-(-n // block_n), -(-k // block_k), sms)
    return SkinnyConfig(block_n, block_k, split_k=split, num_warps=4, num_stages=4, dot=dot)


@functools.cache
def pick_config(kind: str, n: int, k: int, m: int, device: torch.device) -> SkinnyConfig:
    """TUNED's entry for (kind, N, K, m_class(M)), else default_config (cached: eager steps call
    this per Linear)."""
    tuned = TUNED.get((kind, n, k, m_class(m)))
    return tuned if tuned is not None else default_config(kind, n, k, m, sm_count(device))


# ---- references ------------------------------------------------------------------------------


def skinny_linear_ref(
    x: torch.Tensor | Fp8Act, w: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """What `skinny_linear` computes: x [..., K] (or an Fp8Act [M, K]) -> [..., N] in x's dtype.
    Dense: float32 product of the operands. FP8: `fp8_act_linear_ref` / `fp8_linear_ref`."""
    if scale is not None:
        if isinstance(x, Fp8Act):
            return fp8_act_linear_ref(x, w, scale)
        return fp8_linear_ref(x, w, scale, x.dtype)
    return (x.to(torch.float32) @ w.to(torch.float32).t()).to(x.dtype)


# ---- Triton ----------------------------------------------------------------------------------


@jit
def _act_row(
    x_ptr,
    xs_ptr,
    m: tl.constexpr,
    offs_k,
    k_ok,
    kb,
    M,
    stride_xm,
    stride_xsm,
    W_FP8: tl.constexpr,
    X_FP8: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
):
    """Row m of x at this K step -> (values [BK] float32, scale): the e4m3 values and their
    (row, 128-group) scale when W_FP8 (loaded, or quantized here as quantize_act_ref does), else
    x's values and 1. Zeros past row M-1 or column K-1."""
    row_ok = tl.full((), m, tl.int32) < M
    x_ok = k_ok & (tl.zeros_like(offs_k) + m < M)  # NOTE: `k_ok & row_ok` breaks the interpreter
    xm = tl.load(x_ptr + stride_xm * m + offs_k, mask=x_ok, other=0.0).to(tl.float32)  # [BK]
    sm = tl.full((), 1.0, tl.float32)
    if W_FP8:
        if X_FP8:
            sm = tl.load(xs_ptr + stride_xsm * m + kb, mask=row_ok, other=0.0)
        else:
            sm = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xm), axis=0), 1e-12), FP8_MAX_C)
            xm = round_e4m3(tl.clamp(tl.math.div_rn(xm, sm), -FP8_MAX_C, FP8_MAX_C))
    return xm, sm


@jit
def _rows_product(
    w,
    x_ptr,
    xs_ptr,
    offs_k,
    k_ok,
    kb,
    M,
    stride_xm,
    stride_xsm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    W_FP8: tl.constexpr,
    X_FP8: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
):
    """CUDA cores: w [BN, BK] times each of the BLOCK_M rows of x -> [BN, BM] float32, each row
    scaled by its activation scale."""
    wf = w.to(tl.float32)
    cols = tl.arange(0, BLOCK_M)
    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for m in tl.static_range(BLOCK_M):
        xm, sm = _act_row(
            x_ptr, xs_ptr, m, offs_k, k_ok, kb, M, stride_xm, stride_xsm, W_FP8, X_FP8, FP8_MAX_C
        )
        col = tl.sum(wf * xm[None, :], axis=1) * sm  # [BN]
        part += tl.where(cols[None, :] == m, col[:, None], 0.0)
    return part


@jit
def _dot_product(
    w,
    x_ptr,
    xs_ptr,
    offs_k,
    k_ok,
    kb,
    M,
    stride_xm,
    stride_xsm,
    BLOCK_M: tl.constexpr,
    W_FP8: tl.constexpr,
    X_FP8: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
):
    """Tensor cores: w [BN, BK] @ x_tile.T -> [BN, BM] float32 (BM = 16 rows, padded with zeros),
    each row scaled by its activation scale when W_FP8."""
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    x = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
    )  # [BM, BK]
    if W_FP8:
        if X_FP8:
            sx = tl.load(xs_ptr + offs_m * stride_xsm + kb, mask=m_ok, other=0.0)  # [BM]
        else:
            xq, sx = quant_groups(x.to(tl.float32), FP8_MAX_C)
            x = xq.to(w.dtype)
        return tl.dot(w, tl.trans(x)) * sx[None, :]
    return tl.dot(w, tl.trans(x))


@jit
def _load_w(w_rows, kb, n_ok, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BN, BK] tile of W at K step kb (zeros past row N-1 and column K-1)."""
    if EVEN_K:
        return tl.load(w_rows + kb * BLOCK_K, mask=n_ok[:, None], other=0.0)
    k_ok = kb * BLOCK_K + tl.arange(0, BLOCK_K) < K
    return tl.load(w_rows + kb * BLOCK_K, mask=n_ok[:, None] & k_ok[None, :], other=0.0)


@jit(dynamic=("M",))
def _skinny_kernel(
    x_ptr,  # [M, K] activation (e4m3 when X_FP8)
    xs_ptr,  # [M, ceil(K/128)] float32 activation scales (X_FP8)
    w_ptr,  # [N, K] weight
    wsc_ptr,  # [ceil(N/128), ceil(K/128)] float32 weight scales (W_FP8)
    y_ptr,  # [M, N] output
    part_ptr,  # [SPLIT_K, M, N] float32 partials (SPLIT_K > 1)
    lock_ptr,  # [cdiv(N, BLOCK_N)] int32 arrival counters, zero between launches (SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    stride_ym,
    W_FP8: tl.constexpr,
    X_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    kb_total = tl.cdiv(K, BLOCK_K)
    kb_per_split = tl.cdiv(kb_total, SPLIT_K)
    kb_start = pid_k * kb_per_split
    kb_end = tl.minimum(kb_start + kb_per_split, kb_total)

    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + tl.arange(0, BLOCK_K)[None, :]  # [BN, BK]
    wsc_row = wsc_ptr + (pid_n * BLOCK_N // 128) * stride_wsn  # the tile lies in one 128-row block
    ONE_ROW: tl.constexpr = BLOCK_M == 1 and not DOT
    if ONE_ROW:  # elementwise products summed over K once, after the loop
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y.T tile
    if not DOT:
        w = _load_w(w_rows, tl.minimum(kb_start, kb_total - 1), n_ok, K, BLOCK_K, EVEN_K)
    for kb in range(kb_start, kb_end):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        sw = tl.load(wsc_row + kb) if W_FP8 else tl.full((), 1.0, tl.float32)
        if DOT:  # loads that feed tl.dot: Triton's pipeliner keeps num_stages tiles in flight
            w = _load_w(w_rows, kb, n_ok, K, BLOCK_K, EVEN_K)
            part = _dot_product(
                w, x_ptr, xs_ptr, offs_k, k_ok, kb, M, stride_xm, stride_xsm, BLOCK_M, W_FP8, X_FP8, FP8_MAX_C
            )
            acc += sw * part
        else:
            # NOTE: the next tile's load is issued before this one's math (two tiles in flight per
            # program); the last step reloads its own tile rather than read past the split.
            w_next = _load_w(w_rows, tl.minimum(kb + 1, kb_end - 1), n_ok, K, BLOCK_K, EVEN_K)
            if ONE_ROW:
                x0, s0 = _act_row(
                    x_ptr, xs_ptr, 0, offs_k, k_ok, kb, M, stride_xm, stride_xsm, W_FP8, X_FP8, FP8_MAX_C
                )
                acc += w.to(tl.float32) * (x0 * (s0 * sw))[None, :]
            else:
                part = _rows_product(
                    w,
                    x_ptr,
                    xs_ptr,
                    offs_k,
                    k_ok,
                    kb,
                    M,
                    stride_xm,
                    stride_xsm,
                    BLOCK_M,
                    BLOCK_N,
                    W_FP8,
                    X_FP8,
                    FP8_MAX_C,
                )
                acc += sw * part
            w = w_next
    if ONE_ROW:
        acc = tl.sum(acc, axis=1)[:, None]  # [BN, 1]

    offs_m = tl.arange(0, BLOCK_M)
    y_mask = n_ok[:, None] & (offs_m < M)[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, cast_out(acc, y_ptr.dtype.element_ty), mask=y_mask)
    else:
        # fp8_gemm's pattern: store the partial, count arrivals; the last split sums the partials
        # in split order (deterministic) and resets the counter for the next launch.
        mn = offs_m[None, :] * N + offs_n[:, None]
        tl.store(part_ptr + pid_k * M * N + mn, acc, mask=y_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptr + s * M * N + mn, mask=y_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, cast_out(total, y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(lock_ptr + pid_n, 0)


# ---- wrappers --------------------------------------------------------------------------------


def skinny_applies(
    x: torch.Tensor | Fp8Act, w: torch.Tensor, scale: torch.Tensor | None, fp8_everywhere: bool = False
) -> bool:
    """Whether `skinny_linear` takes this product: at most MAX_ROWS rows, and dtypes it handles
    (FP8 weights with a scale; else bf16/fp16 weights with x of the same dtype), where it is the
    faster path: bf16 unless TUNED says None; FP8 only where TUNED holds a config (none today:
    see TUNED's comment), or every FP8 shape with `fp8_everywhere` (A/B runs)."""
    a = x.q if isinstance(x, Fp8Act) else x
    k = a.shape[-1]
    if k == 0 or a.numel() // k > MAX_ROWS:
        return False
    kind = "fp8" if scale is not None else "bf16"
    key = (kind, w.shape[0], k, m_class(max(1, a.numel() // k)))
    if scale is not None:  # FP8: only where TUNED holds a config (it lost inside the decode step)
        return w.dtype == FP8 and (fp8_everywhere or TUNED.get(key) is not None)
    if key in TUNED and TUNED[key] is None:
        return False  # measured slower than cuBLAS (unmeasured shapes take it)
    return not isinstance(x, Fp8Act) and w.dtype in DENSE_DTYPES and x.dtype == w.dtype


def _check(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, cfg: SkinnyConfig) -> None:
    m, k = a.shape
    assert m <= MAX_ROWS, f"skinny_linear takes at most {MAX_ROWS} rows, got {m}"
    assert w.dim() == 2 and w.shape[1] == k and w.stride(-1) == 1, f"x [{m}, {k}] vs w {tuple(w.shape)}"
    assert a.stride(-1) == 1 and a.device == w.device, (a.stride(), a.device, w.device)
    assert cfg.block_n & (cfg.block_n - 1) == 0 and cfg.block_k & (cfg.block_k - 1) == 0, cfg
    assert not cfg.dot or min(cfg.block_n, cfg.block_k) >= 16, cfg
    if scale is None:
        assert w.dtype in DENSE_DTYPES and a.dtype == w.dtype, (a.dtype, w.dtype)
        return
    assert a.dtype in (FP8, *DENSE_DTYPES, torch.float32), a.dtype
    n = w.shape[0]
    assert w.dtype == FP8 and scale.dtype == torch.float32 and scale.is_contiguous(), (w.dtype, scale.dtype)
    assert scale.shape == (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)), (scale.shape, w.shape)
    assert cfg.block_k == BLOCK and BLOCK % cfg.block_n == 0, f"FP8 needs block_k 128, block_n | 128: {cfg}"


def skinny_gemm(
    x: torch.Tensor | Fp8Act,
    w: torch.Tensor,
    scale: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """Triton: x [M, K] (M <= 16, rows contiguous; or an Fp8Act) @ W [N, K].T -> [M, N] in x's dtype.

    One launch, no host sync, CUDA-graph capturable (with split-K, warm up once before capture:
    the lock counters are allocated on first use).
    """
    assert HAS_TRITON, "skinny_gemm needs triton"
    fp8_act = isinstance(x, Fp8Act)
    a, a_scale = (x.q, x.scale) if fp8_act else (x, x)  # a_scale unused unless fp8_act
    (m, k), n = a.shape, w.shape[0]
    cfg = config or pick_config("fp8" if scale is not None else "bf16", n, k, m, a.device)
    _check(a, w, scale, cfg)
    if fp8_act:
        assert a_scale.shape == (m, triton.cdiv(k, BLOCK)) and a_scale.stride(-1) == 1, a_scale.shape
    y = torch.empty(m, n, dtype=x.dtype, device=a.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    tiles = triton.cdiv(n, cfg.block_n)
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    if split > 1:
        part, locks = (
            torch.empty(split, m, n, dtype=torch.float32, device=a.device),
            split_k_locks(a.device, tiles),
        )
    else:
        part = locks = y  # unused
    _skinny_kernel[(tiles, split)](
        a,
        a_scale,
        w,
        scale if scale is not None else w,
        y,
        part,
        locks,
        m,
        n,
        k,
        a.stride(0),
        a_scale.stride(0),
        w.stride(0),
        scale.stride(0) if scale is not None else 0,
        y.stride(0),
        W_FP8=scale is not None,
        X_FP8=fp8_act,
        BLOCK_M=MAX_ROWS if cfg.dot else triton.next_power_of_2(max(m, 1)),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        DOT=cfg.dot,
        EVEN_K=k % cfg.block_k == 0,
        FP8_MAX_C=FP8_MAX,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(),
    )
    return y


def skinny_linear(
    x: torch.Tensor | Fp8Act,
    w: torch.Tensor,
    scale: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """y = x @ W.T for at most 16 rows: x [..., K] (or an Fp8Act [M, K]) -> [..., N] in x's dtype.

    W is bf16/fp16 (x of the same dtype) or e4m3 with `scale` [ceil(N/128), ceil(K/128)] float32
    (x an Fp8Act, or float x quantized in the kernel per row per 128 channels). Contract of
    `skinny_linear_ref`; float32 accumulation, differing only in summation order.
    """
    if isinstance(x, Fp8Act):
        return skinny_gemm(x, w, scale, config)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return skinny_gemm(x2, w, scale, config).reshape(*lead, w.shape[0])
