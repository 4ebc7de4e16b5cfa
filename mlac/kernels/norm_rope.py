"""RMSNorm, optionally fused with the residual add and with per-token FP8 quantization (rope, with
the paged-cache write, is mla_prep.py's).

RMSNorm computes in float32: y = round(x * rsqrt(mean(x^2) + eps)) * weight, rounded to the output
dtype before and after the weight, as transformers' DeepSeek RMSNorm does. With a residual,
x + residual is rounded to the residual's dtype first (what an unfused `residual = x + residual` in
that dtype stores), returned as the new residual, and that rounded value is normalized.
`rms_norm_quant` quantizes that same y (rounded to x's dtype) per token per 128 channels to e4m3
in the same launch, bit for bit `fp8_gemm.quantize_act_ref(rms_norm(x))`: the FP8 GEMMs that read
y then need no quantizing launch of their own, and give the bits they gave before.

Entry points dispatch: Triton on CUDA, the reference on CPU.
"""

from __future__ import annotations

import torch

from mlac.kernels._triton import pdl_launch, pdl_start, tl, triton
from mlac.kernels._triton import use_triton as _use_triton
from mlac.kernels.fp8_quant import Fp8Act, cast_out, quant_groups
from mlac.kernels.gemm.fp8_gemm import BLOCK as QUANT_GROUP
from mlac.kernels.gemm.fp8_gemm import FP8, FP8_MAX, quantize_act_ref

# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def _add_residual_ref(
    x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is None:
        return x.to(torch.float32), None
    new_residual = (x.to(torch.float32) + residual.to(torch.float32)).to(residual.dtype)
    return new_residual.to(torch.float32), new_residual


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., D], weight [D] -> y [..., D] in x's dtype; with residual, (y, new_residual).
    Rounded as transformers' DeepSeek RMSNorm: normalize in float32, cast, times the weight."""
    xf, new_residual = _add_residual_ref(x, residual)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight.to(x.dtype) * normed
    return y if residual is None else (y, new_residual)


def rms_norm_quant_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[Fp8Act, torch.Tensor | None]:
    """x [T, D] -> (Fp8Act of y = rms_norm_ref(x, ...) carrying y, new_residual or None)."""
    out = rms_norm_ref(x, weight, eps, residual)
    y, new_residual = out if residual is not None else (out, None)
    return Fp8Act(*quantize_act_ref(y), y.dtype, y), new_residual


# --------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x, residual, weight, y, residual_out, y_fp8, y_scale,
        stride_x, stride_r, stride_y, stride_ro, stride_q, stride_qs,
        D, eps,
        BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_Y: tl.constexpr, QUANT: tl.constexpr,
        GROUP: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One program per row (token). `y` has x's dtype (x itself when not STORE_Y)."""
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        xv = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(residual + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
            summed = (xv + r).to(residual_out.dtype.element_ty)
            tl.store(residual_out + row * stride_ro + offs, summed, mask=mask)
            xv = summed.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xv * xv, 0) / D + eps)
        w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
        # as transformers: the normalized x rounded to y's dtype, then times the weight
        normed = cast_out(xv * rstd, y.dtype.element_ty).to(tl.float32)
        out = cast_out(normed * w, y.dtype.element_ty)  # [BLOCK_D], 0 past D
        if STORE_Y:
            tl.store(y + row * stride_y + offs, out, mask=mask)
        if QUANT:  # the rounded y, per 128-channel group, as quantize_act_ref
            q, scale = quant_groups(tl.reshape(out.to(tl.float32), [BLOCK_D // GROUP, GROUP]), FP8_MAX)
            tl.store(
                y_fp8 + row * stride_q + offs, tl.reshape(q, [BLOCK_D]).to(y_fp8.dtype.element_ty), mask=mask
            )
            offs_g = tl.arange(0, BLOCK_D // GROUP)
            tl.store(y_scale + row * stride_qs + offs_g, scale, mask=offs_g * GROUP < D)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [N, D] view (a copy only if the leading dims cannot be flattened)."""
    assert t.stride(-1) == 1, "last dim must be contiguous"
    return t.reshape(-1, t.shape[-1])


def _rms_norm_launch(x, weight, eps, residual, quant: bool, keep_y: bool = True):
    """One launch -> (y or None, y_fp8 or None, y_scale or None, new residual or None)."""
    d = x.shape[-1]
    assert weight.shape == (d,) and weight.is_contiguous()
    x2 = _rows(x)
    n = x2.shape[0]
    r2 = r_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.device == x.device
        r2 = _rows(residual)
        r_out = torch.empty(n, d, dtype=residual.dtype, device=x.device)
    block_d = triton.next_power_of_2(d)
    y = torch.empty(n, d, dtype=x.dtype, device=x.device) if keep_y else None
    y_fp8 = y_scale = None
    if quant:
        block_d = max(block_d, QUANT_GROUP)
        y_fp8 = torch.empty(n, d, dtype=FP8, device=x.device)
        y_scale = torch.empty(n, -(-d // QUANT_GROUP), dtype=torch.float32, device=x.device)
    y_arg = y if y is not None else x2  # x's dtype: the kernel rounds to it
    _rms_norm_kernel[(n,)](
        x2, r2 if r2 is not None else x2, weight, y_arg, r_out if r_out is not None else x2,
        y_fp8 if quant else x2, y_scale if quant else weight,
        x2.stride(0), r2.stride(0) if r2 is not None else 0, y.stride(0) if y is not None else 0,
        r_out.stride(0) if r_out is not None else 0, y_fp8.stride(0) if quant else 0,
        y_scale.stride(0) if quant else 0,
        d, eps,
        BLOCK_D=block_d, HAS_RESIDUAL=residual is not None, STORE_Y=keep_y, QUANT=quant, GROUP=QUANT_GROUP,
        FP8_MAX=FP8_MAX, num_warps=min(16, max(1, block_d // 512)), **pdl_launch(),
    )  # fmt: skip
    if r_out is not None:
        r_out = r_out.view(residual.shape)
    return y, y_fp8, y_scale, r_out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim. x [..., D] (rows may be strided, last dim contiguous), weight [D].

    Returns y [..., D] in x's dtype; with residual [..., D], returns (y, new_residual) where
    new_residual = x + residual in the residual's dtype (a new tensor; inputs are not modified).
    """
    if not _use_triton(x, use_triton):
        return rms_norm_ref(x, weight, eps, residual)
    y, _, _, r_out = _rms_norm_launch(x, weight, eps, residual, quant=False)
    y = y.view(x.shape)
    return y if residual is None else (y, r_out)


def rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    keep_y: bool = False,
    use_triton: bool | None = None,
) -> tuple[Fp8Act, torch.Tensor | None]:
    """RMSNorm fused with the per-token per-128-channel e4m3 quantization of its output, one launch.

    x [T, D] (rows may be strided, last dim contiguous) -> (Fp8Act: q [T, D] e4m3, scale
    [T, ceil(D/128)] float32, and with `keep_y` y [T, D] itself in x's dtype, for a reader that
    is not an FP8 GEMM; new_residual [T, D] or None). q and scale are bit for bit
    `quantize_act_ref(rms_norm(x, weight, eps, residual))`.
    """
    assert x.dim() == 2, "x must be [T, D]"
    if not _use_triton(x, use_triton):
        y_act, new_residual = rms_norm_quant_ref(x, weight, eps, residual)
        return y_act if keep_y else y_act._replace(x=None), new_residual
    y, y_fp8, y_scale, r_out = _rms_norm_launch(x, weight, eps, residual, quant=True, keep_y=keep_y)
    return Fp8Act(y_fp8, y_scale, x.dtype, y), r_out


__all__ = [
    "rms_norm",
    "rms_norm_quant",
    "rms_norm_ref",
    "rms_norm_quant_ref",
]
