"""Helpers of the FP8 GEMM and MoE kernel tests (kept out of conftest.py, which others own).

Import this module before anything that imports triton: without CUDA it turns on Triton's CPU
interpreter, and it reloads the kernel modules if something imported them earlier in compiled
mode (a conftest, say), so that their @triton.jit functions are interpreted.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from types import ModuleType

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# In import order: a module comes after those it takes names from, so that a reload rebinds them.
_KERNEL_MODULES = (
    "mlac.kernels.fp8_quant",
    "mlac.kernels.gemm.fp8_gemm",
    "mlac.kernels.moe.align",
    "mlac.kernels.moe.grouped",
    "mlac.kernels.moe.reduce",
    "mlac.kernels.moe.decode_config",
    "mlac.kernels.moe.shared",
    "mlac.kernels.moe.decode_tiles",
    "mlac.kernels.moe.decode",
    "mlac.kernels.moe.decode_sum",
    "mlac.kernels.moe.fused",
)


def kernel_modules() -> dict[str, ModuleType]:
    """The FP8 GEMM and MoE kernel modules by their last name ("fp8_quant", "fp8_gemm", "grouped",
    "decode", "fused", ...), interpreted when there is no CUDA."""
    quant = importlib.import_module(_KERNEL_MODULES[0])
    interpreted = type(quant._act_quant_kernel).__name__ == "InterpretedFunction"
    if HAS_TRITON and not HAS_CUDA and not interpreted:
        for name in _KERNEL_MODULES:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
    return {name.rpartition(".")[2]: importlib.import_module(name) for name in _KERNEL_MODULES}


# Tolerances, from the output dtype. Relative Frobenius error ||out - ref|| / ||ref||.
# bf16 keeps 8 significant bits (epsilon 2^-7 = 7.8e-3): two results that differ only in
# float32 summation order round to the same bf16 value or to neighbours, far under 1e-2.
# With FP8 operands the reference quantizes activations exactly as the kernels do, so a MoE
# output differs from fused_moe_ref only where a bf16-rounded intermediate lands on the other
# side of an e4m3 rounding boundary (an isolated 2^-4 relative change of one element of h).
RTOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float | None = None) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    assert torch.isfinite(out).all(), "non-finite output: an element was not written (poisoned NaN)"
    tol = RTOL[out.dtype] if rtol is None else rtol
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


@contextlib.contextmanager
def poisoned_empty():
    """Make torch.empty return poisoned tensors (float: NaN, int: a large negative number), so
    any buffer a kernel wrapper allocates and the kernel fails to write shows up."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-(2**30) if t.element_size() >= 4 else -100)
        return t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real_empty


def random_fp8_weight(n: int, k: int, lead: tuple[int, ...] = (), device="cpu", scale: float = 1e-2):
    """Random e4m3 weight [*lead, n, k] spread over the e4m3 range, and positive float32 block
    scales [*lead, ceil(n/128), ceil(k/128)] around `scale` (never zero)."""
    fp8 = torch.float8_e4m3fn
    w = (torch.randn(*lead, n, k, device=device) * 64).clamp(-448, 448).to(fp8)
    s = (torch.rand(*lead, -(-n // 128), -(-k // 128), device=device) + 0.5) * scale
    return w, s


def fp8_linear_ref64(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """fp8_linear_ref with the product in float64, the activations quantized on the CPU.

    Leaves only the kernel's own summation order in the comparison: no float32 matmul (whose
    algorithm cuBLAS picks), and IEEE division in the quantization on any device."""
    from mlac.core.fp8 import BLOCK, expand_block_scale
    from mlac.kernels.gemm.fp8_gemm import quantize_act_ref

    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    xq, xs = (t.to(x.device) for t in quantize_act_ref(x.reshape(-1, k).cpu()))
    x_deq = xq.double() * xs.double().repeat_interleave(BLOCK, dim=-1)[:, :k]
    w_deq = w.double() * expand_block_scale(w_scale.double(), n, k)
    return (x_deq @ w_deq.t()).to(out_dtype or x.dtype).reshape(*lead, n)
