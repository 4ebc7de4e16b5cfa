"""The Triton import guard and the one dispatch rule shared by every kernel family.

Triton is optional: a CPU-only install imports every kernel module and runs the pure-torch
references; the `@triton.jit` kernels are defined only when triton is importable.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU runtime must not need triton
    triton = None
    tl = None

HAS_TRITON = triton is not None


def use_triton(x: torch.Tensor, requested: bool | None = None) -> bool:
    """Triton on CUDA tensors (the reference when triton is missing); on CPU tensors only when
    asked, under TRITON_INTERPRET=1 (tests). `requested` True forces Triton, False forces the
    reference, None picks by device; MLAC_FORCE_TRITON=1 acts as True."""
    if requested is None:
        requested = (x.is_cuda and HAS_TRITON) or os.environ.get("MLAC_FORCE_TRITON") == "1"
    if requested and not HAS_TRITON:
        raise RuntimeError("the Triton path was requested but triton is not installed")
    if requested and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return requested
