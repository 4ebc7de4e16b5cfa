"""The Triton import guard, the one dispatch rule shared by every kernel family, and the PDL switch.

Triton is optional: a CPU-only install imports every kernel module and runs the pure-torch
references; the `@triton.jit` kernels are defined only when triton is importable.

Programmatic dependent launch (PDL, Hopper and later): a kernel launched with `launch_pdl=True`
may start while the kernel before it in the stream drains; its CTAs run until `gdc_wait()`, which
blocks until that previous kernel has completed and its writes are visible. CUDA-graph capture
keeps these as programmatic edges, so a replayed decode step overlaps each kernel's launch and
ramp-up with the tail of the one before. The switch, `pdl_on()`: on unless the setting MLAC_PDL
(mlac/settings.py) is 0, when the current GPU is CUDA sm >= 90 (asked once, at the first launch);
always off on CPU and under TRITON_INTERPRET=1 (the interpreter never sees a gdc op: they sit behind
the kernels' `PDL` constexpr).

Every mlac kernel follows one mechanical pattern:

    @triton.jit
    def _my_kernel(x, y, ..., BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)          # FIRST statement: before any load and before any early `return`
        ...

    _my_kernel[grid](x, y, ..., BLOCK=block, num_warps=4, **pdl_launch())

`pdl_start` waits for the previous kernel (a missing wait is a silent race on what it wrote), then
lets the next kernel's CTAs be scheduled (they still wait in their own `pdl_start`). It must come
before an early `return` too: a kernel whose CTAs all exit without waiting could complete before
its predecessor, and the kernel after it would then read that predecessor's output too early.

Kernel caches: `launch_pdl` is a compile option and `PDL` a constexpr, so both are in Triton's cache
key. An artifact prepared with PDL on (the default on Hopper) holds the PDL variants; a server run
with MLAC_PDL=0 finds none of its kernels there and compiles them on first use, unless the artifact
was also prepared under MLAC_PDL=0.
"""

from __future__ import annotations

import functools
import os

import torch

from mlac import settings

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
    reference, None picks by device; the setting MLAC_FORCE_TRITON=1 acts as True.

    NOTE: the interpreter multiplies the raw bits of bf16 `tl.dot` operands (triton-lang/triton
    #11584): a bf16 model forced onto Triton on CPU gives logits near 1e11 (gemv, extend_attention
    and mla_decode dot bf16; the GPU is right) unless tests/kernels/conftest.py's interpreter
    patch is applied, as it is for every test under tests/kernels/. Float32 runs are exact."""
    if requested is None:
        requested = (x.is_cuda and HAS_TRITON) or settings.FORCE_TRITON.get()
    if requested and not HAS_TRITON:
        raise RuntimeError("the Triton path was requested but triton is not installed")
    if requested and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return requested


class CaptureNeedsWarmup(RuntimeError):
    """Raised, before any GPU work, by a launch that CUDA-graph capture cannot record yet: a lazily
    made buffer, or a Triton kernel variant not loaded (its module load is not allowed while the
    stream captures). A capture that meets it is dropped; the step then runs eagerly first
    (runtime/graphs.py, capture_buckets)."""


def refuse_in_capture(device: torch.device, what: str) -> None:
    """Raise CaptureNeedsWarmup when this thread's current CUDA stream is capturing: `what` (a
    buffer made on first use) must be made by an eager run first."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise CaptureNeedsWarmup(f"{what} must be made before CUDA-graph capture")


def pdl_supported() -> bool:
    """Whether this process can launch with PDL: Triton compiling for CUDA (not the interpreter)
    on a current GPU of compute capability 9.0 or more. Initializes CUDA: call it at a launch."""
    if not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1" or torch.version.cuda is None:
        return False  # no Triton, the interpreter, or ROCm (no griddepcontrol)
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@functools.cache
def pdl_on() -> bool:
    """This process's switch, fixed at its first launch: the setting MLAC_PDL is on and PDL is
    supported here. Not decided at import, where asking the GPU would initialize CUDA (and a
    process that initialized CUDA can no longer fork workers)."""
    return settings.PDL.get() and pdl_supported()


def pdl_launch() -> dict[str, bool]:
    """The keyword arguments every mlac kernel launch takes: the kernel's `PDL` constexpr and
    Triton's `launch_pdl` launch option, both `pdl_on()`."""
    on = pdl_on()
    return {"PDL": on, "launch_pdl": on}


if HAS_TRITON:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """A kernel's first statement: with PDL, wait until the previous kernel in the stream has
        completed (its writes visible), then let the next kernel's CTAs be scheduled."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

else:  # no kernel is defined or launched without Triton
    pdl_start = None
