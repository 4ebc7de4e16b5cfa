"""SiLU-gated activation: x [T, 2I] = [gate ‖ up] -> silu(gate) * up [T, I], one launch.

Rounded like the eager expression `F.silu(gate) * up` in x's dtype: silu computes in float32
(x / (1 + exp(-x)), IEEE division) and rounds to x's dtype, then the product of two values of
that dtype is computed exactly in float32 and rounded once more. `silu_mul` dispatches: Triton
on CUDA, the reference on CPU. `silu_mul_quant` writes that same rounded y as e4m3 + per-token
per-128-channel scales instead, in the same launch (for an FP8 down projection that reads only it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlac.core.fp8 import BLOCK as GROUP
from mlac.core.fp8 import FP8_MAX
from mlac.kernels._triton import HAS_TRITON, pdl_launch, pdl_start, tl, triton
from mlac.kernels._triton import use_triton as _use_triton
from mlac.kernels.fp8_quant import Fp8Act, cast_out, interpreting, quant_groups
from mlac.kernels.gemm.fp8_gemm import quantize_act_ref

if HAS_TRITON:
    from triton.language.extra import libdevice
else:  # the CPU runtime must not need triton
    libdevice = None

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> F.silu(gate) * up [T, I] in x's dtype (the eager expression itself)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_quant_ref(x: torch.Tensor) -> Fp8Act:
    """x [T, 2I] -> quantize_act_ref(silu_mul_ref(x)): e4m3 [T, I] + scales [T, ceil(I/128)]."""
    return Fp8Act(*quantize_act_ref(silu_mul_ref(x)), x.dtype)


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(
        x, y, y_scale, stride_x, stride_y, stride_s, I,
        BLOCK: tl.constexpr, EXACT_EXP: tl.constexpr, QUANT: tl.constexpr,
        GROUP_SIZE: tl.constexpr, FP8_MAX_C: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One program per (row, BLOCK columns of the output). QUANT: y is e4m3, y_scale holds the
        scales of the BLOCK // GROUP_SIZE groups (BLOCK a multiple of GROUP_SIZE). Rounds to x's dtype."""
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        dtype = x.dtype.element_ty
        gate = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
        # EXACT_EXP: libdevice's expf, what torch's CUDA silu calls (tl.exp is ex2.approx); the
        # interpreter has no libdevice, and its tl.exp (numpy's) is already accurate.
        e = libdevice.exp(-gate) if EXACT_EXP else tl.exp(-gate)
        silu = cast_out(tl.math.div_rn(gate, 1.0 + e), dtype).to(tl.float32)
        h = cast_out(silu * up, dtype)  # [BLOCK], 0 past I
        if QUANT:  # the rounded h, per 128-channel group, as quantize_act_ref
            q, scale = quant_groups(
                tl.reshape(h.to(tl.float32), [BLOCK // GROUP_SIZE, GROUP_SIZE]), FP8_MAX_C
            )
            tl.store(y + row * stride_y + offs, tl.reshape(q, [BLOCK]).to(y.dtype.element_ty), mask=mask)
            g = tl.program_id(1) * (BLOCK // GROUP_SIZE) + tl.arange(0, BLOCK // GROUP_SIZE)
            tl.store(y_scale + row * stride_s + g, scale, mask=g * GROUP_SIZE < I)
        else:
            tl.store(y + row * stride_y + offs, h, mask=mask)


def _silu_mul_launch(x: torch.Tensor, quant: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch: (y [T, I] in x's dtype, None) or (e4m3 y [T, I], scales [T, ceil(I/128)])."""
    assert HAS_TRITON, "silu_mul needs triton"
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2I], got {tuple(x.shape)}"
    assert x.stride(-1) == 1, f"x needs a contiguous last dim, got strides {x.stride()}"
    assert x.dtype in DTYPES, f"silu_mul takes bf16/fp16/float32, got {x.dtype}"
    t, i = x.shape[0], x.shape[1] // 2
    y = torch.empty(t, i, dtype=torch.float8_e4m3fn if quant else x.dtype, device=x.device)
    s = torch.empty(t, triton.cdiv(i, GROUP), dtype=torch.float32, device=x.device) if quant else None
    if t == 0 or i == 0:
        return y, s
    block = min(1024, triton.next_power_of_2(i))
    block = max(block, GROUP) if quant else block
    _silu_mul_kernel[(t, triton.cdiv(i, block))](
        x, y, s if quant else y, x.stride(0), y.stride(0), s.stride(0) if quant else 0, i,
        BLOCK=block, EXACT_EXP=not interpreting(), QUANT=quant,
        GROUP_SIZE=GROUP, FP8_MAX_C=FP8_MAX, num_warps=4 if block >= 512 else 1, **pdl_launch(),
    )  # fmt: skip
    return y, s


def silu_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton `silu_mul`; contract as `silu_mul`."""
    return _silu_mul_launch(x, quant=False)[0]


def silu_mul(x: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """x [T, 2I] (gate ‖ up halves; rows may be strided, last dim contiguous; bf16/fp16/float32)
    -> y [T, I] = silu(gate) * up, contiguous, in x's dtype, rounded as `silu_mul_ref`."""
    if _use_triton(x, use_triton):
        return silu_mul_triton(x)
    return silu_mul_ref(x)


def silu_mul_quant(x: torch.Tensor, use_triton: bool | None = None) -> Fp8Act:
    """x [T, 2I] as `silu_mul` -> Fp8Act(e4m3 [T, I], scales [T, ceil(I/128)] float32), one launch:
    bit for bit `quantize_act_ref(silu_mul(x))`, the input of an FP8 down projection."""
    if _use_triton(x, use_triton):
        return Fp8Act(*_silu_mul_launch(x, quant=True), x.dtype)
    return silu_mul_quant_ref(x)


__all__ = ["silu_mul", "silu_mul_quant", "silu_mul_quant_ref", "silu_mul_ref", "silu_mul_triton"]
