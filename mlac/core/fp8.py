"""The FP8 block format, in one place: 128×128 blocks of e4m3 with one float32 scale each.

    w ≈ q.float() * scale[row // 128, col // 128]        (the scale multiplies to dequantize)

This is DeepSeek-V3's release format (`weight_scale_inv`) and mlac's artifact format (`x.scale`).
The last block of a dimension that 128 does not divide is partial: its scale covers the rows or
columns that exist. The reader, the passes, the kernels and synth import these facts from here;
this module imports nothing from mlac but the lazy-tensor type.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mlac.core.lazy import LazyTensor, stack

BLOCK = 128  # rows and columns of one scale block
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value: torch.finfo(FP8).max
DEQUANT_DTYPE = torch.bfloat16  # what an FP8 weight becomes when the target is not FP8
ROWS_PER_STEP = 16 * BLOCK  # rows quantized at a time: bounds the float32 temporaries

BlockKernel = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """[..., N, K] weight -> [..., ceil(N/128), ceil(K/128)] scales."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // BLOCK), -(-cols // BLOCK))


def quantize_block_kernel(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [rb, 128, cb, 128] -> (e4m3 blocks, float32 scales [rb, cb]).

    scale = amax(block) / 448 (at least 1e-12); q = clamp(w * (1 / scale)) rounded to e4m3, so a
    block's largest magnitude maps to 448.
    """
    amax = blocks.abs().amax(dim=(1, 3)).float()
    scale = amax.clamp(min=1e-12) / FP8_MAX
    y = (blocks.float() * (1.0 / scale)[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return y.to(FP8), scale


def quantize_blocks(
    w: torch.Tensor, kernel: BlockKernel = quantize_block_kernel
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (e4m3 [N, K], float32 scales [ceil(N/128), ceil(K/128)]).

    Partial blocks are zero-padded (zeros never raise a block's amax). `kernel` maps a run of
    whole block rows as `quantize_block_kernel` does (the compiler passes a compiled one); it
    sees at most ROWS_PER_STEP rows at a time.
    """
    n, k = w.shape
    rb, cb = -(-n // BLOCK), -(-k // BLOCK)
    aligned = n % BLOCK == 0 and k % BLOCK == 0
    src = w if aligned else F.pad(w, (0, cb * BLOCK - k, 0, rb * BLOCK - n))
    blocks = src.view(rb, BLOCK, cb, BLOCK)
    step = ROWS_PER_STEP // BLOCK  # block rows per step
    q = torch.empty(rb, BLOCK, cb, BLOCK, dtype=FP8)
    scale = torch.empty(rb, cb, dtype=torch.float32)
    for r in range(0, rb, step):
        q[r : r + step], scale[r : r + step] = kernel(blocks[r : r + step])
    q = q.view(rb * BLOCK, cb * BLOCK)
    return (q if aligned else q[:n, :k].contiguous()), scale


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: int = BLOCK) -> torch.Tensor:
    """[..., ceil(rows/b), ceil(cols/b)] block scales -> [..., rows, cols] elementwise scales."""
    s = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return s[..., :rows, :cols]


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """FP8 weight [..., N, K] with block scales -> float32 [..., N, K] (scale multiplies)."""
    n, k = w.shape[-2:]
    return w.to(torch.float32) * expand_block_scale(scale.to(torch.float32), n, k, block)


def dequantize_lazy(w: LazyTensor, scale: LazyTensor) -> LazyTensor:
    """A lazy FP8 weight and its lazy scales -> the lazy DEQUANT_DTYPE weight.

    A stacked tensor (experts) whose scales are stacked alike is dequantized one part at a
    time, so that memory holds one expert, not the stack.
    """
    if _stacked(w) and _stacked(scale):
        return stack([dequantize_lazy(p, s) for p, s in zip(w.parts, scale.parts, strict=True)])
    return LazyTensor(
        w.shape, DEQUANT_DTYPE, lambda: dequantize_blocks(w.load(), scale.load()).to(DEQUANT_DTYPE)
    )


def _stacked(t: LazyTensor) -> bool:
    return bool(t.parts) and len(t.parts[0].shape) == len(t.shape) - 1
