"""Block-FP8 linear through cuBLAS (`torch._scaled_mm`), where it is the faster path; Triton elsewhere.

cuBLASLt (CUDA 12.9 and later, on Hopper) multiplies e4m3 operands with DeepSeek's block scaling:
float32 scales per 1x128 block of the activations (per token per 128 channels, the bits of
`quantize_act_ref`) and per 128x128 block of the weight (the artifact's format), accumulating in
float32. That is the contract of `fp8_linear_ref`; only the summation order differs. torch picks
that scaling from the shapes and strides of the scale tensors:

    a         [Mp, K] e4m3, row-major          scale_a  [Mp, K/128], strides (1, Mp): M-major
    b = W.T   [K, N] column-major: a view      scale_b  = W.scale.T [K/128, ceil(N/128)], strides (1, K/128)

HAZARD: cuBLASLt reads each scale tensor with a leading dimension aligned to 16 bytes (4 floats),
while torch passes the stride it finds; a torch that checks the unpadded stride then reads a weight
scale whose K/128 is not a multiple of 4 wrong, without an error. So K must be a multiple of 512
(no copy of W or its scale, no memory at load) and Mp is M rounded up to a multiple of 4 (rows
M..Mp are zero rows, written by act_quant's m_major layout in the quantizing launch, or by the
copy that relays a producer's Fp8Act; their outputs are dropped).

Availability is decided without a trial launch, from versions and the GPU (`cublas_unavailable`):
deterministic, nothing runs at start, and a trial could not tell a right result from a wrong one
cheaply. Which products take cuBLAS is a measured rule of rows and shape (`cublas_takes`). A
cuBLAS call compiles nothing: `mlac prepare` has nothing to store for it, and the warm-up meets
only act_quant's m_major variant (step_variants.py).
"""

from __future__ import annotations

import math

import torch

from mlac.core.fp8 import BLOCK, FP8
from mlac.kernels.fp8_quant import M_MAJOR_ROWS, Fp8Act, act_quant, padded_rows
from mlac.kernels.fp8_quant import use_triton as _use_triton
from mlac.kernels.gemm.fp8_gemm import quantize_act_ref

# Measured (benchmarks/results/kernels_peers_h200.json: one H200, torch 2.11, CUDA 13.0; mlac's
# time includes its activation quantization, cuBLAS's does not), mlac's Triton GEMM over cuBLAS:
# - 256 rows: 1.47-3.11 at every DeepSeek shape with block scaling (V2-Lite q_proj, o_proj, w13;
#   V3 qkv_a, q_b, o_proj, w13, w2): cuBLAS;
# - 32 rows: 1.05-1.21 where N >= K (V2-Lite q_proj 1.08, o_proj 1.05, w13 1.21; V3 q_b 1.12, w13
#   1.19), 0.92-0.97 where N < K (V3 qkv_a 0.97, o_proj 0.95, w2 0.92: mlac's decode tiles split
#   K over the SMs there): cuBLAS where N >= K, up to the 64 rows of those decode tiles;
# - 1 row: mlac faster at 8 of 9 shapes than cuBLAS's rowwise scaling (its block scaling took no
#   1-row call there: a 1-float leading dimension of the M-major scales): Triton.
# End to end (mlac bench, one H100, the same call; benchmarks/results/bench_fp8_cublas_ab_h100.json),
# that rule alone cost V2-Lite FP8 decode 2.2% at batch 32 and 3.4% at 256 (27 layers; 11% at 256 with
# 4 layers) and gained V3-shaped FP8 1.1% and 2.1%: each cuBLAS call adds launches (the relayout of a
# producer's scales, m_major_operands: 18 more elementwise kernels per 4-layer step) and leaves the PDL
# chain of the Triton kernels around it, which V2-Lite's small products (<= 6.3M weights, ~15 us) do not
# win back. So a weight takes cuBLAS only from CUBLAS_MIN_WEIGHT elements: all of V3's linears (qkv_a
# 15.1M and up), of V2-Lite's only the first layer's dense w13 (44.8M).
CUBLAS_MIN_ROWS = 32
CUBLAS_MIN_WEIGHT = 8 << 20  # N * K elements
DECODE_TILE_ROWS = 64  # fp8_gemm.gemm_config_for: split-K decode tiles up to here
K_MULTIPLE = 4 * BLOCK  # whole 128-blocks, 4 per 16 bytes of a weight-scale row (the HAZARD above)
N_MULTIPLE = 16  # torch._scaled_mm's own requirement on b's dimensions
MIN_TORCH = (2, 11)  # block scaling chosen by scale layout in torch._scaled_mm (measured: 2.11)
MIN_CUDA = (12, 9)  # cuBLASLt's VEC128_32F / BLK128x128_32F scale modes


def cublas_shape(n: int, k: int) -> bool:
    """Whether cuBLAS's block scaling takes a weight [n, k] as stored: K a multiple of 512, N of 16."""
    return k > 0 and k % K_MULTIPLE == 0 and n % N_MULTIPLE == 0


def cublas_takes(m: int, n: int, k: int) -> bool:
    """Whether an FP8 product of m rows with a weight [n, k] runs through cuBLAS, where cuBLAS
    block scaling is available: a shape it takes (cublas_shape) and the measured rules above (rows,
    then the weight's size)."""
    if m < CUBLAS_MIN_ROWS or n * k < CUBLAS_MIN_WEIGHT or not cublas_shape(n, k):
        return False
    return m > DECODE_TILE_ROWS or n >= k


def _version(text: str | None) -> tuple[int, ...]:
    """(major, minor) of "2.11.0+cu130", "13.0", "2.12.0a0+git..."; () for None."""
    if not text:
        return ()
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in text.split("+")[0].split(".")[:2])


def cublas_unavailable(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why cuBLAS's block-scaled FP8 GEMM cannot serve FP8 linears on `device` computing in
    `dtype`, or None when it can: CUDA (not ROCm), torch >= 2.11 built with CUDA >= 12.9, an sm90 GPU
    (cuBLASLt's 1x128 / 128x128 scale modes are Hopper's), bf16 output (what was measured). No
    launch: the same answer on every call. Asks the GPU its compute capability (CUDA initialized)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type} device"
    if dtype != torch.bfloat16:
        return f"{dtype} compute (bf16 only)"
    if torch.version.hip is not None:
        return f"ROCm {torch.version.hip}"
    if _version(torch.version.cuda) < MIN_CUDA:
        return f"CUDA {torch.version.cuda} (block scaling needs CUDA 12.9)"
    if _version(torch.__version__) < MIN_TORCH:
        return f"torch {torch.__version__} (block scaling from torch 2.11)"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"sm{major}{minor} GPU (block scaling on sm90)"
    return None


def m_major_operands(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [M, K] e4m3 and scale [M, G] float32 (a producer's Fp8Act, or quantize_act_ref's) ->
    act_quant(m_major=True)'s layout: q [Mp, K] and scale [Mp, G] with strides (1, Mp), rows
    M..Mp zero rows (q 0, scale 1). One copy of the scales; q is copied only when M is not a
    multiple of 4 (or its rows are not contiguous). CUDA-graph safe (torch ops only)."""
    m, k = q.shape
    mp = padded_rows(m)
    store = torch.empty(scale.shape[1], mp, dtype=torch.float32, device=scale.device)  # [G, Mp]
    store[:, :m].copy_(scale.t())
    if mp != m:
        store[:, m:].fill_(1.0)
    if mp == m and q.stride() == (k, 1):
        return q, store.t()
    padded = torch.zeros(mp, k, dtype=torch.uint8, device=q.device)  # e4m3 0x00 is +0.0
    padded[:m].copy_(q.view(torch.uint8))
    return padded.view(FP8), store.t()


def check_operands(q: torch.Tensor, scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> None:
    """The layouts torch._scaled_mm must find for DeepSeek's block scaling (module docstring)."""
    (mp, k), (n, kw) = q.shape, w.shape
    assert k == kw and k % K_MULTIPLE == 0 and n % N_MULTIPLE == 0, f"x [*, {k}] vs w {tuple(w.shape)}"
    assert q.dtype == w.dtype == FP8 and q.stride() == (k, 1) and w.is_contiguous(), "e4m3, contiguous rows"
    assert mp % M_MAJOR_ROWS == 0 and scale.shape == (mp, k // BLOCK), (scale.shape, q.shape)
    assert scale.dtype == torch.float32 and scale.stride() == (1, mp), f"scale strides {scale.stride()}"
    assert w_scale.dtype == torch.float32 and w_scale.is_contiguous(), "w_scale: contiguous float32"
    assert w_scale.shape == (math.ceil(n / BLOCK), k // BLOCK), (w_scale.shape, w.shape)


def cublas_fp8_linear(
    x: torch.Tensor | Fp8Act,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """y = x @ dequant(w).T through cuBLAS: x [..., K] bf16, or an Fp8Act [M, K], with w [N, K] e4m3
    and w_scale [ceil(N/128), K/128] float32 -> [..., N] bf16 (x's dtype). K % 512 == 0, N % 16 == 0.

    A plain x is quantized by act_quant in the m_major layout (one launch, as the Triton path's
    act_quant; the reference on CPU, or as `use_triton` forces); an Fp8Act's bits are relaid
    (m_major_operands). Contract of `fp8_linear_ref` / `fp8_act_linear_ref`, summation order
    only. The caller decides that cuBLAS takes the product (cublas_unavailable, cublas_takes)."""
    n, k = w.shape
    if isinstance(x, Fp8Act):
        lead, dtype = x.q.shape[:-1], x.dtype
        q, scale = m_major_operands(x.q, x.scale)
    else:
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, k)  # [M, K]
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if _use_triton(x2, use_triton):
            q, scale = act_quant(x2, m_major=True)
        else:
            q, scale = m_major_operands(*quantize_act_ref(x2))
    assert dtype == torch.bfloat16, f"the cuBLAS route computes in bf16, not {dtype}"
    check_operands(q, scale, w, w_scale)
    y = torch._scaled_mm(q, w.t(), scale_a=scale, scale_b=w_scale.t(), out_dtype=dtype)  # [Mp, N]
    return y[: math.prod(lead)].view(*lead, n)
