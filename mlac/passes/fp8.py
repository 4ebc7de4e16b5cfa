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

from mlac.compiler.lazy import LazyTensor, concat_rows, stack
from mlac.compiler.reader import scale_shape
from mlac.config import FP8_BLOCK
from mlac.kernels.fp8_gemm import FP8, FP8_MAX
from mlac.passes import PassContext

NAME = "fp8"
QUANTIZED = (
    "attn.w_qkv_a", "attn.wq", "attn.w_kv_a", "attn.wq_b", "attn.wo",
    "mlp.w13", "mlp.w2", "moe.w13", "moe.w2", "moe.shared.w13", "moe.shared.w2",
)  # fmt: skip
ROWS_PER_STEP = 16 * FP8_BLOCK  # bounds the float32 temporaries of one quantization step
COMPILE_MIN_ELEMENTS = 1 << 20  # below this (tiny test models), eager beats a first compile


def params(ctx: PassContext) -> dict:
    return {
        "fmt": "e4m3",
        "block": [FP8_BLOCK, FP8_BLOCK],
        "scale_dtype": "float32",
        "tensors": list(QUANTIZED),
    }


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (e4m3 [N, K], float32 scales [ceil(N/128), ceil(K/128)]).

    scale = amax(block) / 448; q = clamp(w / scale) in e4m3 (multiplying by 1/scale).
    """
    n, k = w.shape
    rb, cb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    aligned = n % FP8_BLOCK == 0 and k % FP8_BLOCK == 0
    src = w if aligned else torch.nn.functional.pad(w, (0, cb * FP8_BLOCK - k, 0, rb * FP8_BLOCK - n))
    blocks = src.view(rb, FP8_BLOCK, cb, FP8_BLOCK)
    step = max(1, ROWS_PER_STEP // FP8_BLOCK)  # block rows per step: bounds float32 temporaries
    q = torch.empty(rb, FP8_BLOCK, cb, FP8_BLOCK, dtype=FP8)
    scale = torch.empty(rb, cb, dtype=torch.float32)
    kernel = _compiled_kernel() if w.numel() >= COMPILE_MIN_ELEMENTS else _quantize_kernel
    for r in range(0, rb, step):
        q[r : r + step], scale[r : r + step] = kernel(blocks[r : r + step])
    q = q.view(rb * FP8_BLOCK, cb * FP8_BLOCK)
    return (q if aligned else q[:n, :k].contiguous()), scale


def _quantize_kernel(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [rb, 128, cb, 128] -> (e4m3 blocks, float32 scales [rb, cb])."""
    amax = blocks.abs().amax(dim=(1, 3)).float()
    scale = amax.clamp(min=1e-12) / FP8_MAX
    y = (blocks.float() * (1.0 / scale)[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return y.to(FP8), scale


@functools.cache
def _compiled_kernel():
    """The same function fused by Inductor into two loops over the data (~3x faster on CPU);
    the eager kernel when no C++ compiler is available."""
    compiled = torch.compile(_quantize_kernel, dynamic=True)
    probe = torch.randn(1, FP8_BLOCK, 2, FP8_BLOCK, dtype=torch.bfloat16)
    try:
        got, want = compiled(probe), _quantize_kernel(probe)
    except Exception as e:  # noqa: BLE001 - any compile failure falls back to eager
        warnings.warn(
            f"fp8: torch.compile unavailable ({type(e).__name__}); quantizing in eager mode", stacklevel=2
        )
        return _quantize_kernel
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
    if t.parts and all(p.shape[0] % FP8_BLOCK == 0 for p in t.parts[:-1]):
        pairs = [quantize_lazy(p) for p in t.parts]
        return concat_rows([q for q, _ in pairs]), concat_rows([s for _, s in pairs])
    kept: list[torch.Tensor] = []  # the scale computed along with the weight, until written

    def weight() -> torch.Tensor:
        q, s = quantize_blocks(t.load())
        kept[:] = [s]
        return q

    def scale() -> torch.Tensor:
        return kept.pop() if kept else quantize_blocks(t.load())[1]

    return LazyTensor(t.shape, FP8, weight), LazyTensor(scale_shape(t.shape), torch.float32, scale)
