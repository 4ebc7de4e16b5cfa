"""fp8: block-wise 128×128 e4m3 weights with float32 scales (`x` -> `x`, `x.scale`).

Applies to every linear weight of the decoder layers (see QUANTIZED). A weight that already
carries a `.scale` (an FP8 source kept as it is) is left untouched, block for block. Scales
multiply to dequantize: w ≈ x.float() * scale[row // 128, col // 128].

Quantization is lazy and streams like the rest: a stacked or fused tensor whose parts end on
block boundaries is quantized part by part; the scales of a part are kept (they are 1/16384 of
its size) so that writing `x.scale` after `x` does not quantize twice.
"""

from __future__ import annotations

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
ROWS_PER_STEP = 8 * FP8_BLOCK  # bounds the float32 temporaries of one quantization step


def params(ctx: PassContext) -> dict:
    return {"fmt": "e4m3", "block": [FP8_BLOCK, FP8_BLOCK], "scale_dtype": "float32", "tensors": list(QUANTIZED)}


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (e4m3 [N, K], float32 scales [ceil(N/128), ceil(K/128)])."""
    n, k = w.shape
    qs, ss = [], []
    for strip in w.split(ROWS_PER_STEP):
        q, s = _quantize_strip(strip)
        qs.append(q)
        ss.append(s)
    return torch.cat(qs) if len(qs) > 1 else qs[0], torch.cat(ss) if len(ss) > 1 else ss[0]


def _quantize_strip(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    rb, cb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.nn.functional.pad(w.to(torch.float32), (0, cb * FP8_BLOCK - k, 0, rb * FP8_BLOCK - n))
    blocks = padded.view(rb, FP8_BLOCK, cb, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [rb, cb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rb * FP8_BLOCK, cb * FP8_BLOCK)[:n, :k].contiguous(), scale


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
