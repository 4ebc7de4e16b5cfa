"""Block-FP8 GEMM (W8A8): e4m3 weights with 128x128 float32 block scales.

Activations are quantized on the fly per token per 128 channels (e4m3, float32 scale), the
product is accumulated in float32. `fp8_linear` dispatches: Triton on CUDA, the reference on CPU.
It also takes an activation its producer already quantized (`Fp8Act`: a norm or SiLU·mul kernel
that writes e4m3 + scales in the launch that makes it), and then quantizes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlac.core.fp8 import BLOCK, FP8, FP8_MAX, dequantize_blocks
from mlac.kernels._triton import pdl_launch, pdl_start, refuse_in_capture
from mlac.kernels.fp8_quant import HAS_TRITON, Fp8Act, act_quant, cast_out, jit, round_e4m3, tl, triton
from mlac.kernels.fp8_quant import use_triton as _use_triton


def quantize_act_ref(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-`group`-channel e4m3 quantization of activations.

    x [M, K] -> (x_fp8 [M, K], scale [M, ceil(K/group)] float32), with x ≈ x_fp8 * scale.
    """
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.to(torch.float32), (0, groups * group - k)).view(m, groups, group)
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    # NOTE: a tensor divisor, not the Python scalar: CUDA divides by a scalar through its
    # reciprocal (off by an ulp at times), CPU and the Triton kernels divide exactly.
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, groups * group)[:, :k], scale.squeeze(-1)


def fp8_linear_ref(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Reference W8A8: x [..., K] (float), w [N, K] e4m3, w_scale [ceil(N/128), ceil(K/128)] -> [..., N].

    Emulates the GPU kernel exactly up to summation order: activations are quantized per token
    per 128 channels, both operands are dequantized to float32 and multiplied.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x_act = Fp8Act(*quantize_act_ref(x.reshape(-1, k)), x.dtype)
    y = fp8_act_linear_ref(x_act, w, w_scale, out_dtype)
    return y.reshape(*lead, w.shape[0])


def fp8_act_linear_ref(
    x: Fp8Act, w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Reference W8A8 on a quantized activation: x.q [M, K] e4m3 + x.scale -> [M, N] in out_dtype
    (default x.dtype)."""
    k = x.q.shape[-1]
    x_deq = x.q.to(torch.float32) * x.scale.repeat_interleave(BLOCK, dim=-1)[:, :k]
    return (x_deq @ dequantize_blocks(w, w_scale).t()).to(out_dtype or x.dtype)


# ---------------------------------------------------------------------------------------------
# Triton: C[M, N] = A[M, K] @ dequant(B[N, K]).T, one 128-wide K block per step, so each step's
# partial product is scaled once by a_scale[m, kb] * b_scale[n // 128, kb] and added in float32.


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch options of `fp8_gemm`. block_n > 128 must be a multiple of 128."""

    block_m: int
    block_n: int
    split_k: int = 1  # K-block ranges reduced by the last CTA of each tile (decode)
    group_m: int = 8  # grouped tile order (L2 reuse of B across M tiles)
    num_warps: int = 4
    num_stages: int = 3
    fuse_quant: bool = False  # quantize A inside the GEMM (else a separate act_quant pass)
    sub_k: int = 1  # 128-wide K blocks per main-loop iteration


@jit
def _fp8_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    ws_ptr,
    lock_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    QUANT_A: tl.constexpr,  # a is bf16/fp16/fp32: quantize each [row, 128] group here
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    SUB_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    kb_total = tl.cdiv(K, BLOCK_K)
    kb_per_split = tl.cdiv(kb_total, SPLIT_K)
    kb_start = pid_k * kb_per_split
    kb_end = min(kb_start + kb_per_split, kb_total)

    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]  # [BM, BK] at k = 0
    b_rows = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]  # [BN, BK]
    as_rows = as_ptr + offs_m * stride_asm  # [BM]
    if BLOCK_N <= 128:  # the tile lies in one 128-row block of B: one scale per K step
        bs_rows = bs_ptr + (pid_n * BLOCK_N // 128) * stride_bsn
    else:
        bs_rows = bs_ptr + (offs_n // 128) * stride_bsn  # [BN]
    k_end = min(kb_end * BLOCK_K, K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb0 in range(kb_start, kb_end, SUB_K):
        # SUB_K consecutive 128-wide K blocks per iteration: their products are issued together
        for j in tl.static_range(SUB_K):
            kb = kb0 + j
            kb_c = min(kb, kb_total - 1)  # a block past the end loads zeros; its scale stays finite
            if EVEN_K and SUB_K == 1:
                a = tl.load(a_rows + kb * BLOCK_K, mask=m_mask[:, None], other=0.0)
                b = tl.load(b_rows + kb * BLOCK_K, mask=n_mask[:, None], other=0.0)
            else:
                k_mask = (kb * BLOCK_K + offs_k) < k_end
                a = tl.load(a_rows + kb * BLOCK_K, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_rows + kb * BLOCK_K, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if QUANT_A:  # same arithmetic as quantize_act_ref
                af = a.to(tl.float32)
                a_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(af), axis=1), 1e-12), FP8_MAX_C)  # [BM]
                a = round_e4m3(tl.clamp(tl.math.div_rn(af, a_s[:, None]), -FP8_MAX_C, FP8_MAX_C)).to(b.dtype)
            else:
                a_s = tl.load(as_rows + kb_c, mask=m_mask, other=0.0)
            if BLOCK_N <= 128:
                b_s = tl.load(bs_rows + kb_c)
                acc += tl.dot(a, tl.trans(b)) * (a_s * b_s)[:, None]
            else:
                b_s = tl.load(bs_rows + kb_c, mask=n_mask, other=0.0)
                acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]

    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    c_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, cast_out(acc, c_ptr.dtype.element_ty), mask=c_mask)
    else:
        # Each split stores its float32 partial; the last split to arrive (counter per tile) sums
        # them in split order and resets the counter, so the result is deterministic and the
        # counters stay zero between launches.
        mn = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + mn, acc, mask=c_mask)
        tl.debug_barrier()
        tile = pid_m * num_pid_n + pid_n
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(ws_ptr + s * M * N + mn, mask=c_mask, other=0.0, cache_modifier=".cg")
            tl.store(c_ptrs, cast_out(total, c_ptr.dtype.element_ty), mask=c_mask)
            tl.atomic_xchg(lock_ptr + tile, 0)


_SM_COUNT: dict[torch.device, int] = {}
_LOCKS: dict[torch.device, torch.Tensor] = {}
_OLD_LOCKS: list[torch.Tensor] = []  # never freed: captured CUDA graphs may still point at them


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (4 for CPU tensors: the interpreter), cached."""
    if device not in _SM_COUNT:
        cuda = device.type == "cuda"
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
    return _SM_COUNT[device]


def split_k_locks(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 tile counters, one buffer per device (the kernel leaves them zeroed).

    NOTE: allocated on first use: warm up (as Triton's JIT needs anyway) before graph capture.
    Launches that share the buffer must not run concurrently on different streams.
    """
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < n:
        refuse_in_capture(device, "fp8_gemm's split-K counters")
        if locks is not None:
            _OLD_LOCKS.append(locks)
        locks = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _LOCKS[device] = locks
    return locks


def split_k_for(tiles: int, k: int, sms: int, ctas_per_sm: int = 2, min_k_blocks: int = 4) -> int:
    """Power-of-two split of K that brings the grid to about ctas_per_sm CTAs per SM, keeping
    at least min_k_blocks 128-wide K blocks per split."""
    kb = -(-k // BLOCK)
    split = 1
    while tiles * split < ctas_per_sm * sms and kb >= 2 * split * min_k_blocks:
        split *= 2
    return split


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), as `triton.next_power_of_2`, without Triton."""
    return 1 << max(0, n - 1).bit_length()


def int_class(v: int) -> str:
    """How Triton specializes an integer argument not marked `dynamic` (fp8_quant.jit): "1", "16"
    (divisible by 16) or "any". Each class is its own compiled variant."""
    return "1" if v == 1 else "16" if v % 16 == 0 else "any"


def gemm_variant(m: int, n: int, k: int, sms: int) -> tuple[GemmConfig, str]:
    """The `_fp8_gemm_kernel` variant an [M, K] x [N, K] product compiles: its tiles and M's class
    (M is specialized)."""
    return gemm_config_for(m, n, k, sms), int_class(m)


def pick_gemm_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """Default tiles: decode (M <= 64) streams B over many CTAs (split-K when N gives too few
    tiles); larger M uses 128x128 fp8 wgmma tiles. Activations are quantized by a separate
    act_quant pass (measured faster than quantizing inside the GEMM's A load: see NOTES)."""
    return gemm_config_for(m, n, k, sm_count(device))


def gemm_config_for(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """`pick_gemm_config` on a GPU of `sms` SMs (pure: the warm-up plans with it)."""
    if m <= 64:
        block_m = max(16, next_power_of_2(m))
        block_n = 64
        tiles = -(-m // block_m) * -(-n // block_n)
        split = split_k_for(tiles, k, sms)
        return GemmConfig(block_m, block_n, split_k=split, num_warps=4, num_stages=4)
    if m <= 256:
        return _MID
    if k >= 2048:  # two K blocks per step: fewer waits on the per-block scaled wgmma results
        return _PREFILL_SUB_K
    return _PREFILL


_MID = GemmConfig(64, 128, num_warps=4, num_stages=4)
_PREFILL_SUB_K = GemmConfig(128, 128, num_warps=8, num_stages=3, sub_k=2)
_PREFILL = GemmConfig(128, 64, num_warps=4, num_stages=4)


def _check_weight(k: int, w: torch.Tensor, w_scale: torch.Tensor, device: torch.device) -> None:
    n = w.shape[0]
    assert w.dim() == 2 and w.shape[1] == k, f"x [*, {k}] vs w {tuple(w.shape)}"
    assert w.dtype == FP8 and w.is_contiguous(), "w must be contiguous e4m3 [N, K]"
    assert w_scale.dtype == torch.float32 and w_scale.is_contiguous(), "w_scale must be contiguous float32"
    assert w_scale.shape == (math.ceil(n / BLOCK), math.ceil(k / BLOCK)), (w_scale.shape, w.shape)
    assert device == w.device == w_scale.device


def fp8_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Triton W8A8 GEMM: x [M, K] float, w [N, K] e4m3, w_scale [ceil(N/128), ceil(K/128)] fp32 -> [M, N].

    Contract as `fp8_linear_ref` (activations quantized per token per 128 channels, float32
    accumulation, one scale product per 128-wide K block); differs only in summation order.
    """
    assert HAS_TRITON, "fp8_gemm needs triton"
    assert x.dim() == 2, x.shape
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    _check_weight(x.shape[1], w, w_scale, x.device)
    m, k = x.shape
    cfg = config or pick_gemm_config(m, w.shape[0], k, x.device)
    if m == 0 or k == 0 or w.shape[0] == 0:
        return _launch(x, x, w, w_scale, out_dtype, cfg)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cfg.fuse_quant:
        return _launch(x, x, w, w_scale, out_dtype, cfg)  # x's scale argument unused
    return _launch(*act_quant(x), w, w_scale, out_dtype, cfg)


def fp8_act_gemm(
    x: Fp8Act,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Triton W8A8 GEMM on an activation its producer quantized: x.q [M, K] e4m3 (contiguous rows),
    x.scale [M, ceil(K/128)] float32 -> [M, N] in out_dtype (default x.dtype). Bits as `fp8_gemm`
    on the activation x stands for."""
    assert HAS_TRITON, "fp8_act_gemm needs triton"
    q, s = x.q, x.scale
    assert q.dim() == 2 and q.dtype == FP8 and q.stride(-1) == 1, (q.shape, q.dtype, q.stride())
    m, k = q.shape
    assert s.dtype == torch.float32 and s.shape == (m, math.ceil(k / BLOCK)) and s.stride(-1) == 1, s.shape
    _check_weight(k, w, w_scale, q.device)
    cfg = config or pick_gemm_config(m, w.shape[0], k, q.device)
    assert not cfg.fuse_quant, "an Fp8Act is quantized already: fuse_quant does not apply"
    return _launch(q, s, w, w_scale, out_dtype or x.dtype, cfg)


def _launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: GemmConfig,
) -> torch.Tensor:
    """One `_fp8_gemm_kernel` launch: a [M, K] e4m3 with a_scale, or float with cfg.fuse_quant."""
    (m, k), n = a.shape, w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    assert cfg.block_n <= 128 or cfg.block_n % 128 == 0, cfg
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = max(1, min(cfg.split_k, triton.cdiv(k, BLOCK)))
    if split > 1:
        ws = torch.empty(split, m, n, dtype=torch.float32, device=a.device)
        locks = split_k_locks(a.device, tiles)
    else:
        ws = locks = out  # unused
    _fp8_gemm_kernel[(tiles, split)](
        a,
        a_scale,
        w,
        w_scale,
        out,
        ws,
        locks,
        m,
        n,
        k,
        a.stride(0),
        a_scale.stride(0),
        w.stride(0),
        w_scale.stride(0),
        out.stride(0),
        QUANT_A=cfg.fuse_quant,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=BLOCK,
        SPLIT_K=split,
        GROUP_M=cfg.group_m,
        EVEN_K=k % BLOCK == 0,
        FP8_MAX_C=FP8_MAX,
        SUB_K=cfg.sub_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(),
    )
    return out


def fp8_linear(
    x: torch.Tensor | Fp8Act,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    use_triton: bool | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """y = x @ dequant(w).T with per-token activation quantization: x [..., K] -> [..., N].

    x may be an `Fp8Act` [M, K] its producer quantized: nothing is quantized here, and the
    result has the bits the activation it stands for would give.
    Dispatches on device: the Triton kernel on CUDA, the reference on CPU. `use_triton` forces
    either path (True on CPU runs the kernel under TRITON_INTERPRET=1).
    """
    if not isinstance(x, torch.Tensor):  # an Fp8Act
        if not _use_triton(x.q, use_triton):
            return fp8_act_linear_ref(x, w, w_scale, out_dtype)
        return fp8_act_gemm(x, w, w_scale, out_dtype, config)
    if not _use_triton(x, use_triton):
        return fp8_linear_ref(x, w, w_scale, out_dtype)
    lead, k = x.shape[:-1], x.shape[-1]
    y = fp8_gemm(x.reshape(-1, k), w, w_scale, out_dtype or x.dtype, config)
    return y.reshape(*lead, w.shape[0])
