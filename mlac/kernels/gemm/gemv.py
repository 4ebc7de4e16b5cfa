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
dtype and accumulate in float32. The configs, and where the skinny GEMM applies: gemv_configs.py.
"""

from __future__ import annotations

import torch

from mlac.core.fp8 import BLOCK, FP8, FP8_MAX
from mlac.kernels._triton import pdl_launch, pdl_start
from mlac.kernels.fp8_quant import HAS_TRITON, Fp8Act, cast_out, jit, quant_groups, round_e4m3, tl, triton
from mlac.kernels.gemm.fp8_gemm import fp8_act_linear_ref, fp8_linear_ref, split_k_locks
from mlac.kernels.gemm.gemv_configs import DENSE_DTYPES, MAX_ROWS, SkinnyConfig, pick_config

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
