"""Building blocks of the model: tensors handed out by name, Linear, RMSNorm and YaRN rope.

Every module is built from the loaded tensors of one rank (`Weights`), under the names of the
tensor contract (artifacts/README.md). Nothing here transforms a weight: the compiler did that.
"""

from __future__ import annotations

import enum
import logging

import torch
import torch.nn.functional as F
from torch import nn

from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.core.rope import rope_parameters
from mlac.kernels.fp8_quant import Fp8Act, use_triton
from mlac.kernels.gemm.fp8_cublas import cublas_fp8_linear, cublas_takes, cublas_unavailable
from mlac.kernels.gemm.fp8_gemm import FP8, fp8_linear
from mlac.kernels.gemm.gemv import skinny_linear
from mlac.kernels.gemm.gemv_configs import skinny_applies
from mlac.kernels.norm_rope import rms_norm, rms_norm_quant

log = logging.getLogger("mlac.runtime")


class Weights:
    """The tensors of one rank, handed out by name exactly once.

    `take` fails on a missing tensor; `finish` fails on any tensor nobody took, so a model and
    an artifact that disagree about the tensor set are refused at construction, not at run time.
    NOTE: the tensors may still be loading (loader.start_load: the CUDA graphs are captured while
    they stream in): a module keeps what it takes and computes nothing from its values.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], source: str = "artifact"):
        self._tensors = dict(tensors)
        self._source = source

    def take(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise MlacError(f"{self._source}: tensor {name!r} is missing (the model needs it)")
        return self._tensors.pop(name)

    def has(self, name: str) -> bool:
        """Whether `name` is still to be taken."""
        return name in self._tensors

    def take_optional(self, name: str) -> torch.Tensor | None:
        return self._tensors.pop(name, None)

    def finish(self) -> None:
        if self._tensors:
            names = ", ".join(sorted(self._tensors)[:5])
            raise MlacError(f"{self._source}: {len(self._tensors)} tensor(s) the model does not use: {names}")


def take_weight(weights: Weights, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear weight and its block scale: (FP8 weight, float32 scale) or (weight, None)."""
    w = weights.take(name)
    scale = weights.take_optional(f"{name}.scale")
    if (scale is not None) != (w.dtype == FP8):
        what = "has a .scale but is not FP8" if scale is not None else "is FP8 but has no .scale"
        raise MlacError(f"tensor {name!r} {what} (dtype {w.dtype})")
    return w, scale


class Linear(nn.Module):
    """y = x @ W.T, dispatching on the stored format of W, and on the row count.

    An FP8 (e4m3) weight carries `<name>.scale` (float32 128x128 block scales) and runs through
    the block-FP8 GEMM; any other weight runs through F.linear in the activation dtype. An FP8
    Linear (`fp8`) also takes its input already quantized (`Fp8Act`, made by the kernel that
    produced it): same bits, one quantizing launch fewer.

    Decode-sized inputs (at most 16 rows, M = x.numel() // K) on the Triton path (CUDA) run
    through the skinny GEMM instead where gemv_configs.skinny_applies says it is the faster path
    (kernels/gemm/gemv.py: one launch that streams W, same numerics up to summation order). M is
    fixed per CUDA-graph bucket, so the choice is fixed at capture.

    An FP8 Linear whose `cublas` is set (once, by route_fp8_linears, when the model is built) runs
    the products that fp8_cublas.cublas_takes from their rows and shape through cuBLAS's
    block-scaled GEMM (same contract, summation order only); the others keep the Triton GEMM.
    """

    def __init__(self, weights: Weights, name: str):
        super().__init__()
        weight, scale = take_weight(weights, name)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.cublas = False  # FP8 products may run through cuBLAS (route_fp8_linears)

    @property
    def fp8(self) -> bool:
        """True when the weight is block FP8: the input may then be an Fp8Act."""
        return self.scale is not None

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:  # [..., in] -> [..., out] in x.dtype
        if self._skinny(x):
            return skinny_linear(x, self.weight, self.scale)
        if self._cublas(x):
            return cublas_fp8_linear(x, self.weight, self.scale)
        if self.scale is not None:
            return fp8_linear(x, self.weight, self.scale, out_dtype=x.dtype)
        assert not isinstance(x, Fp8Act), "an Fp8Act feeds only FP8 weights"
        return F.linear(x, self.weight)

    def _skinny(self, x: torch.Tensor | Fp8Act) -> bool:
        """Whether x goes to the skinny GEMM (the one place that decides)."""
        a = x.q if isinstance(x, Fp8Act) else x
        return skinny_applies(x, self.weight, self.scale) and use_triton(a)

    def _cublas(self, x: torch.Tensor | Fp8Act) -> bool:
        """Whether x goes to cuBLAS: a fixed field, x's dtype (bf16, the model's) and its row count
        M, so one CUDA-graph bucket (M rows) takes the same path at capture and at every replay."""
        a = x.q if isinstance(x, Fp8Act) else x
        rows = a.numel() // max(1, a.shape[-1])
        return self.cublas and x.dtype == torch.bfloat16 and cublas_takes(rows, *self.weight.shape)


def route_fp8_linears(model: nn.Module, cublas: bool, device: torch.device, dtype: torch.dtype) -> None:
    """Set, once, while `model` is built, which FP8 Linears in it may run through cuBLAS: all, when
    `cublas` (ModelOptions.fp8_cublas) and cuBLAS's block scaling serves this device and compute
    dtype (fp8_cublas.cublas_unavailable, decided without a launch), else none. Logs which."""
    why = "off (ModelOptions.fp8_cublas)" if not cublas else cublas_unavailable(device, dtype)
    fp8 = [m for m in model.modules() if isinstance(m, Linear) and m.fp8]
    for lin in fp8:
        lin.cublas = why is None
    if fp8:
        routed = "cuBLAS where fp8_cublas.cublas_takes, Triton elsewhere"
        log.info("FP8 linears: %s", routed if why is None else f"Triton (cuBLAS block scaling: {why})")


class Reads(enum.Enum):
    """The form in which a module reads its input, so that the norm that makes it writes just that."""

    X = "x"  # the activation itself
    FP8 = "fp8"  # only FP8 GEMMs read it: its Fp8Act, nothing else
    FP8_AND_X = "fp8+x"  # FP8 GEMMs and another reader (the MoE router): an Fp8Act carrying x


def reads_of(*linears: Linear) -> Reads:
    """Reads.FP8 when every one of `linears` (the only readers of an activation) is FP8."""
    return Reads.FP8 if all(lin.fp8 for lin in linears) else Reads.X


class RMSNorm(nn.Module):
    """x / rms(x) times the weight, computed in float32 (kernels/norm_rope.py: one launch on CUDA).

    With `residual`, the pre-norm residual stream is fused in: returns (norm(x + residual),
    x + residual), the sum rounded to the residual's dtype, as an unfused add would store it.
    `reads` (fixed at construction, from the module that reads the output) makes the output an
    `Fp8Act` quantized in the same launch (Reads.FP8, FP8_AND_X): the bits the FP8 GEMMs reading
    it computed from the plain output, one quantizing launch per GEMM fewer."""

    def __init__(self, weights: Weights, name: str, eps: float, reads: Reads = Reads.X):
        super().__init__()
        self.register_buffer("weight", weights.take(name), persistent=False)
        self.eps = eps
        self.reads = reads

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | Fp8Act | tuple[torch.Tensor | Fp8Act, torch.Tensor]:
        if self.reads is Reads.X:
            return rms_norm(x, self.weight, self.eps, residual)
        keep_x = self.reads is Reads.FP8_AND_X
        y_act, new_residual = rms_norm_quant(x, self.weight, self.eps, residual, keep_y=keep_x)
        return y_act if residual is None else (y_act, new_residual)


# ---- rope --------------------------------------------------------------------------------------


class RotaryEmbedding(nn.Module):
    """Rotate-half rope over the (de-interleaved) rope dims, cos/sin computed from positions."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__()
        inv_freq, self.attention_factor = rope_parameters(config)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rope] float32 (cat(θ, θ) layout, attention factor applied)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, rope/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., rope]; cos/sin [T, rope] float32. Computed in float32, returned in x's dtype."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.to(torch.float32)
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
