"""fp8: block-wise 128×128 e4m3 weights with float32 scales (`x` -> `x`, `x.scale`).

Applies to every linear weight of the decoder layers (see QUANTIZED). A weight that already
carries a `.scale` (an FP8 source kept as it is) is left untouched, block for block. Scales
multiply to dequantize: w ≈ x.float() * scale[row // 128, col // 128].

Quantization is lazy and streams like the rest: a stacked or fused tensor whose parts end on
block boundaries is quantized part by part; the scales of a part are kept (they are 1/16384 of
its size) so that writing `x.scale` after `x` does not quantize twice.
"""

from __future__ import annotations

import functools
import warnings

import torch

from mlac.core.fp8 import BLOCK, FP8, quantize_block_kernel, quantize_blocks, scale_shape
from mlac.core.lazy import LazyTensor, concat_rows, stack
from mlac.passes import PassContext

NAME = "fp8"
QUANTIZED = (
    "attn.w_qkv_a", "attn.wq", "attn.w_kv_a", "attn.wq_b", "attn.wo",
    "mlp.w13", "mlp.w2", "moe.w13", "moe.w2", "moe.shared.w13", "moe.shared.w2",
    "eh_proj",  # MTP layers only (compiler/mtp.py)
)  # fmt: skip
COMPILE_MIN_ELEMENTS = 1 << 20  # below this (tiny test models), eager beats a first compile


def params(ctx: PassContext) -> dict:
    return {
        "fmt": "e4m3",
        "block": [BLOCK, BLOCK],
        "scale_dtype": "float32",
        "tensors": list(QUANTIZED),
    }


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`mlac.core.fp8.quantize_blocks`, with its kernel compiled for large weights (same bits)."""
    kernel = _compiled_kernel() if w.numel() >= COMPILE_MIN_ELEMENTS else quantize_block_kernel
    return quantize_blocks(w, kernel)


@functools.cache
def _compiled_kernel():
    """The block kernel fused by Inductor into two loops over the data (~3x faster on CPU);
    the eager kernel when no C++ compiler is available."""
    compiled = torch.compile(quantize_block_kernel, dynamic=True)
    probe = torch.randn(1, BLOCK, 2, BLOCK, dtype=torch.bfloat16)
    try:
        got, want = compiled(probe), quantize_block_kernel(probe)
    except Exception as e:  # noqa: BLE001 - any compile failure falls back to eager
        warnings.warn(
            f"fp8: torch.compile unavailable ({type(e).__name__}); quantizing in eager mode", stacklevel=2
        )
        return quantize_block_kernel
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    return compiled


def run(tensors: dict[str, LazyTensor], ctx: PassContext) -> dict[str, LazyTensor]:
    if not ctx.options.fp8 or ctx.layer is None:
        return tensors
    out = dict(tensors)
    for suffix in QUANTIZED:
        name = f"layers.{ctx.layer}.{suffix}"
        if name in out and name + ".scale" not in out:
            out[name], out[name + ".scale"] = quantize_lazy(out[name])
    return out


def quantize_lazy(t: LazyTensor) -> tuple[LazyTensor, LazyTensor]:
    """Lazy (weight, scale) for a 2-D weight or a stack of them, part by part where possible."""
    if t.parts and len(t.shape) == 3:  # stacked experts: each part is one expert's matrix
        pairs = [quantize_lazy(p) for p in t.parts]
        return stack([q for q, _ in pairs]), stack([s for _, s in pairs])
    if t.parts and all(p.shape[0] % BLOCK == 0 for p in t.parts[:-1]):
        pairs = [quantize_lazy(p) for p in t.parts]
        return concat_rows([q for q, _ in pairs]), concat_rows([s for _, s in pairs])
    kept: list[torch.Tensor] = []  # the scale computed along with the weight, until written

    def weight() -> torch.Tensor:
        q, s = quantize(t.load())
        kept[:] = [s]
        return q

    def scale() -> torch.Tensor:
        return kept.pop() if kept else quantize(t.load())[1]

    return LazyTensor(t.shape, FP8, weight), LazyTensor(scale_shape(t.shape), torch.float32, scale)
