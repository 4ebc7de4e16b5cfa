"""Shared set-up for kernel tests.

Without CUDA, Triton kernels run under the interpreter on CPU tensors: TRITON_INTERPRET must be set
before triton (or any kernel module) is imported, which is why it is set here, at conftest import.
Tests marked `gpu` are skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Device the Triton path runs on: CUDA when present, else CPU under the interpreter.
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
CAN_RUN_TRITON = HAS_TRITON and (HAS_CUDA or INTERPRET)


def _patch_interpreter_bf16_dot() -> None:
    """Triton's interpreter (3.9 at least) stores bf16 as raw uint16 and matmuls the raw bits in
    tl.dot. Widen bf16 dot operands to float32 first (exact), which is what the hardware computes."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_mlac_bf16_fix", False):
        return
    original = builder.create_dot

    def widen(t):
        if t.dtype == tl.bfloat16:
            return interpreter.TensorHandle((t.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return t

    def create_dot(self, a, b, d, *args, **kwargs):
        return original(self, widen(a), widen(b), d, *args, **kwargs)

    create_dot._mlac_bf16_fix = True
    builder.create_dot = create_dot


def _patch_interpreter_downcasts() -> None:
    """The interpreter narrows float32 to bf16 by truncation and to fp8 without carrying a rounded
    mantissa into the exponent; the hardware rounds to nearest even. Narrowing float conversions
    between float32, float16, bf16 and the two fp8 formats go through torch instead (also RTNE)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_mlac_rtne_fix", False):
        return
    to_torch = {
        tl.float32: torch.float32,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
    }
    raw = {4: (np.int32, torch.int32), 2: (np.int16, torch.int16), 1: (np.uint8, torch.uint8)}

    def narrowing(src, dst) -> bool:
        return src in to_torch and dst in to_torch and dst.primitive_bitwidth < src.primitive_bitwidth

    def convert(handle, dst):
        src = handle.dtype.scalar
        np_raw, torch_raw = raw[src.primitive_bitwidth // 8]
        data = np.ascontiguousarray(handle.data).view(np_raw)
        t = torch.from_numpy(data.copy()).view(torch_raw).view(to_torch[src]).to(to_torch[dst])
        np_out, torch_out = raw[dst.primitive_bitwidth // 8]
        out = t.view(torch_out).numpy().view(interpreter._get_np_dtype(dst))
        return interpreter.TensorHandle(out.reshape(handle.data.shape), dst)

    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def patched_cast(self, src, dst_type):
        if narrowing(src.dtype.scalar, dst_type.scalar):
            return convert(src, dst_type.scalar)
        return cast_impl(self, src, dst_type)

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        rtz = getattr(getattr(interpreter, "_ir", None), "ROUNDING_MODE", None)
        if narrowing(src.dtype.scalar, dst_type.scalar) and (rtz is None or rounding_mode != rtz.RTZ):
            return convert(src, dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    patched_cast._mlac_rtne_fix = True
    builder.cast_impl = patched_cast
    builder.create_fp_trunc = patched_cast
    builder.create_fp_to_fp = patched_fp_to_fp


if HAS_TRITON and INTERPRET:
    _patch_interpreter_bf16_dot()
    _patch_interpreter_downcasts()


@pytest.fixture
def triton_device() -> str:
    if not CAN_RUN_TRITON:
        pytest.skip("triton is not installed (or not runnable here)")
    return TRITON_DEVICE


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a tensor with NaN (or the integer minimum) so that any element a kernel leaves
    unwritten fails the comparison."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).min)


@pytest.fixture
def poison_empty(monkeypatch):
    """torch.empty returns poisoned tensors for the test's duration, so that a buffer a wrapper
    allocates itself (an output, split-KV partials) and a kernel leaves unwritten shows up."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t if t.dtype == torch.bool else poison(t)

    monkeypatch.setattr(torch, "empty", empty)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()
