"""Per-token, per-128-channel e4m3 activation quantization (Triton), and the Triton import guard.

The reference is `mlac.kernels.gemm.fp8_gemm.quantize_act_ref`; this kernel matches it bit for bit
(same float32 amax, IEEE division, round-to-nearest-even e4m3 conversion).

Triton is optional: a CPU-only install imports every kernel module, defines nothing it cannot,
and runs the pure-torch references. `use_triton(...)` is the one dispatch rule of the family.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from mlac.core.fp8 import BLOCK as GROUP
from mlac.core.fp8 import FP8_MAX
from mlac.kernels._triton import HAS_TRITON, pdl_launch, pdl_start, tl, triton, use_triton  # noqa: F401 (re-exported)


def jit(fn=None, *, dynamic: tuple[str, ...] = ()):
    """`triton.jit` when Triton is installed, else the function unchanged (never launched).

    `dynamic` names integer arguments that vary with the batch (token and row counts): Triton then
    compiles one variant for all their values instead of one per "== 1" / "divisible by 16" class,
    so that the kernels a server meets form a closed set that `mlac prepare` can compile ahead."""
    if fn is None:
        return lambda f: jit(f, dynamic=dynamic)
    if not HAS_TRITON:
        return fn
    return triton.jit(fn, do_not_specialize=list(dynamic)) if dynamic else triton.jit(fn)


def interpreting() -> bool:
    """True under Triton's CPU interpreter, whose bf16 `tl.dot` multiplies the raw uint16 bits:
    kernels then upcast bf16 dot operands to float32 (a constexpr; GPU code is unchanged)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class Fp8Act(NamedTuple):
    """An activation quantized per token per 128 channels, as a producer hands it to FP8 GEMMs.

    q [M, K] float8_e4m3fn and scale [M, ceil(K/128)] float32 with x ~= q * scale (per group):
    exactly the bits `fp8_gemm.quantize_act_ref(x)` gives for the activation x it stands for;
    dtype is x's (an FP8 GEMM's default output dtype, as it is for x itself). `x` carries that
    activation too when a reader other than an FP8 GEMM needs it (the MoE router), else None.
    """

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    x: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@jit
def round_e4m3(v):
    """Round float32 `v` (|v| <= 448) to the nearest e4m3 value, ties to even, in float32.

    The hardware conversion already rounds this way; doing it first makes `.to(float8e4nv)` exact
    everywhere, including Triton's CPU interpreter, whose own float8 rounding is wrong
    (ties away, and no carry into the exponent).
    """
    bits = v.to(tl.int32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 121)  # below 2^-6: subnormal grid
    ulp = ((exp - 3) << 23).to(tl.float32, bitcast=True)  # e4m3 spacing: 2^(e - 127 - 3)
    inv_ulp = ((257 - exp) << 23).to(tl.float32, bitcast=True)
    y = tl.abs(v) * inv_ulp  # exact: power-of-two scaling, 0 <= y < 16
    r = ((y + 12582912.0) - 12582912.0) * ulp  # 1.5 * 2^23: rounds to an integer, ties to even
    # copy the sign bit (tiny negatives round to -0.0; a float negation compiles to 0 - r: +0.0)
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@jit
def round_bf16(v):
    """Round float32 `v` to the nearest bfloat16 value (ties to even), kept in float32.

    Emulates a store to bf16 and reload (the references round there); exact in the interpreter,
    which truncates on `.to(bfloat16)`. NaN/inf are not expected here.
    """
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@jit
def cast_out(v, dtype: tl.constexpr):
    """float32 -> output dtype with round-to-nearest-even (explicit for bf16: see round_bf16)."""
    if dtype == tl.bfloat16:
        v = round_bf16(v)
    return v.to(dtype)


@jit
def quant_groups(v, FP8_MAX_C: tl.constexpr):
    """float32 v [R, 128] (one quantization group per row) -> (e4m3 values as float32 [R, 128],
    scales [R]): the arithmetic of `quantize_act_ref` (IEEE division, ties-to-even e4m3)."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12), FP8_MAX_C)  # [R]
    q = round_e4m3(tl.clamp(tl.math.div_rn(v, scale[:, None]), -FP8_MAX_C, FP8_MAX_C))
    return q, scale


# m_major: rows padded to a multiple of this, so that each column of the M-major scales starts
# 16-byte aligned, as cuBLASLt's 1x128 block scaling needs (kernels/gemm/fp8_cublas.py)
M_MAJOR_ROWS = 4


def padded_rows(m: int) -> int:
    """The rows of an m_major quantization of m rows: m rounded up to a multiple of M_MAJOR_ROWS."""
    return -(-m // M_MAJOR_ROWS) * M_MAJOR_ROWS


@jit(dynamic=("M_OUT", "stride_sg"))
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    M_OUT,
    K,
    groups,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    BLOCK_R: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    PDL: tl.constexpr,
):
    # one program: BLOCK_R (row, 128-channel group) pairs, row-major over [M_OUT, groups]; rows
    # M..M_OUT (m_major padding) are zero rows: q 0, scale 1
    pdl_start(PDL)
    idx = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R]
    row = idx // groups
    g = idx % groups
    c = g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [R, GS]
    live = row < M_OUT
    in_x = row < M
    x = tl.load(x_ptr + row[:, None] * stride_xm + c, mask=in_x[:, None] & (c < K), other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)  # [R]
    scale = tl.where(in_x, tl.math.div_rn(amax, FP8_MAX_C), 1.0)
    q = round_e4m3(tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX_C, FP8_MAX_C))
    tl.store(q_ptr + row[:, None] * stride_qm + c, q.to(q_ptr.dtype.element_ty), mask=live[:, None] & (c < K))
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=live)


def act_quant(x: torch.Tensor, m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, last dim contiguous) -> (q [M, K] e4m3, scale [M, ceil(K/128)] fp32).

    Triton kernel; same contract and bits as `fp8_gemm.quantize_act_ref`. `m_major`: the layout
    cuBLAS's 1x128 block scaling reads (kernels/gemm/fp8_cublas.py), in the same launch: q [Mp, K]
    and scale [Mp, G] with strides (1, Mp) (a view of [G, Mp] storage), Mp = padded_rows(M); rows
    M..Mp are zero rows (q 0, scale 1), the first M rows the bits above.
    """
    assert HAS_TRITON, "act_quant needs triton"
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be 2-D with contiguous rows, got {tuple(x.shape)}"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    m, k = x.shape
    groups = triton.cdiv(k, GROUP)
    m_out = padded_rows(m) if m_major else m
    q = torch.empty(m_out, k, dtype=torch.float8_e4m3fn, device=x.device)
    if m_major:
        s = torch.empty(groups, m_out, dtype=torch.float32, device=x.device).t()  # [Mp, G], strides (1, Mp)
    else:
        s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m_out == 0 or k == 0:
        return q, s
    block_r = 16
    _act_quant_kernel[(triton.cdiv(m_out * groups, block_r),)](
        x,
        q,
        s,
        m,
        m_out,
        k,
        groups,
        x.stride(0),
        q.stride(0),
        s.stride(0),
        s.stride(1),
        BLOCK_R=block_r,
        GROUP_SIZE=GROUP,
        FP8_MAX_C=FP8_MAX,
        num_warps=4,
        **pdl_launch(),
    )
    return q, s


__all__ = [
    "HAS_TRITON",
    "M_MAJOR_ROWS",
    "Fp8Act",
    "act_quant",
    "cast_out",
    "interpreting",
    "jit",
    "padded_rows",
    "quant_groups",
    "round_bf16",
    "round_e4m3",
    "use_triton",
]
