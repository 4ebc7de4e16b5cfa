"""SiLU-gated activation: x [T, 2I] = [gate ‖ up] -> silu(gate) * up [T, I], one launch.

Rounded like the eager expression `F.silu(gate) * up` in x's dtype: silu computes in float32
(x / (1 + exp(-x)), IEEE division) and rounds to x's dtype, then the product of two values of
that dtype is computed exactly in float32 and rounded once more. `silu_mul` dispatches: Triton
on CUDA, the reference on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlac.kernels._triton import HAS_TRITON, tl, triton
from mlac.kernels._triton import use_triton as _use_triton
from mlac.kernels.fp8_quant import cast_out, interpreting

if HAS_TRITON:
    from triton.language.extra import libdevice
else:  # the CPU runtime must not need triton
    libdevice = None

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> F.silu(gate) * up [T, I] in x's dtype (the eager expression itself)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(
        x, y, stride_x, stride_y, I,
        BLOCK: tl.constexpr, EXACT_EXP: tl.constexpr,
    ):  # fmt: skip
        """One program per (row, BLOCK columns of the output)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        dtype = y.dtype.element_ty
        gate = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
        # EXACT_EXP: libdevice's expf, what torch's CUDA silu calls (tl.exp is ex2.approx); the
        # interpreter has no libdevice, and its tl.exp (numpy's) is already accurate.
        e = libdevice.exp(-gate) if EXACT_EXP else tl.exp(-gate)
        silu = cast_out(tl.math.div_rn(gate, 1.0 + e), dtype).to(tl.float32)
        tl.store(y + row * stride_y + offs, cast_out(silu * up, dtype), mask=mask)


def silu_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton `silu_mul`; contract as `silu_mul`."""
    assert HAS_TRITON, "silu_mul_triton needs triton"
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2I], got {tuple(x.shape)}"
    assert x.stride(-1) == 1, f"x needs a contiguous last dim, got strides {x.stride()}"
    assert x.dtype in DTYPES, f"silu_mul takes bf16/fp16/float32, got {x.dtype}"
    t, i = x.shape[0], x.shape[1] // 2
    y = torch.empty(t, i, dtype=x.dtype, device=x.device)
    if t == 0 or i == 0:
        return y
    block = min(1024, triton.next_power_of_2(i))
    _silu_mul_kernel[(t, triton.cdiv(i, block))](
        x, y, x.stride(0), y.stride(0), i,
        BLOCK=block, EXACT_EXP=not interpreting(), num_warps=4 if block >= 512 else 1,
    )  # fmt: skip
    return y


def silu_mul(x: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """x [T, 2I] (gate ‖ up halves; rows may be strided, last dim contiguous; bf16/fp16/float32)
    -> y [T, I] = silu(gate) * up, contiguous, in x's dtype, rounded as `silu_mul_ref`."""
    if _use_triton(x, use_triton):
        return silu_mul_triton(x)
    return silu_mul_ref(x)


__all__ = ["silu_mul", "silu_mul_ref", "silu_mul_triton"]
