"""Whether `--attention-backend flashinfer` can run here: refused with one line naming the reason,
before anything loads. No torch at import: `mlac serve` checks the launch's own choices before any
process starts (cli/flags.py), the engine checks the artifact and the device before it loads
(Engine.from_artifact).

FlashInfer's MLA decode (kernels/attention/flashinfer_mla.py) runs where all of these hold:
- flashinfer is installed (and imports: checked where the engine imports it);
- the device is a CUDA GPU of compute capability 8.0 or more (FlashInfer's fa2 MLA kernels; fa3 on 9.0);
- the compute dtype is bfloat16 or float16 (its kernels take no float32);
- the artifact's KV cache stores the compute dtype: mlac's FP8 caches carry a per-layer scale that
  FlashInfer's MLA wrapper does not take;
- the latent dims are DeepSeek's, kv_lora_rank 512 and qk_rope_head_dim 64 (the dims FlashInfer's
  MLA kernels are built and tested for);
- no DP attention (its steps run mlac's own kernels: the backend would not be used).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING, Protocol

from mlac.core.errors import MlacError

if TYPE_CHECKING:
    from mlac.core.artifact import Manifest

FLAG = "--attention-backend flashinfer"
FLASHINFER_DTYPES = ("bfloat16", "float16")
FLASHINFER_DIMS = (512, 64)  # (kv_lora_rank, qk_rope_head_dim)
FLASHINFER_MIN_CAPABILITY = (8, 0)
DISTRIBUTION = "flashinfer-python"  # the package pip installs `flashinfer` from


class Launch(Protocol):
    """What check_backend reads of RuntimeOptions (which imports kernel_cache, which imports this)."""

    attention_backend: str
    device: object
    dtype: str


def flashinfer_installed() -> bool:
    """Whether a `flashinfer` package is on the path (found, not imported: importing it costs seconds)."""
    return importlib.util.find_spec("flashinfer") is not None


def flashinfer_version() -> str | None:
    """The installed flashinfer's version ("0.6.11"), None where it is not installed."""
    if not flashinfer_installed():
        return None
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # a source checkout on the path: ask the module
        from flashinfer import __version__  # type: ignore[import-not-found]

        return str(__version__)


def refuse_launch(backend: str, device: str | None = None, dtype: str | None = None) -> None:
    """MlacError when `backend` cannot run with the launch's own `device` (as given: None is the
    default, cuda where a GPU is) and compute `dtype`, or is not installed. No torch, no import of
    flashinfer: what a command knows from its flags alone."""
    if backend != "flashinfer":
        return
    if device is not None and str(device).partition(":")[0] != "cuda":
        raise MlacError(f"{FLAG}: needs a CUDA device, not {device}; use --attention-backend triton")
    if dtype is not None and str(dtype).removeprefix("torch.") not in FLASHINFER_DTYPES:
        raise MlacError(
            f"{FLAG}: FlashInfer's MLA kernels take {' or '.join(FLASHINFER_DTYPES)}, not --dtype {dtype}"
        )
    if not flashinfer_installed():
        raise MlacError(f"{FLAG}: flashinfer is not installed (pip install {DISTRIBUTION}); or use triton")


def check_backend(options: Launch, manifest: Manifest) -> None:
    """MlacError (one line) when options.attention_backend cannot run this artifact on options.device:
    the launch's choices (refuse_launch), then the artifact's KV cache, latent dims and plan, then
    the GPU's compute capability (torch imported here)."""
    if options.attention_backend != "flashinfer":
        return
    refuse_launch(options.attention_backend, str(options.device), options.dtype)
    kv = manifest.options.kv_cache_dtype
    if kv != "bf16":
        raise MlacError(
            f"{FLAG}: the artifact's KV cache is {kv}, which FlashInfer's MLA path does not read (mlac's "
            "FP8 cache has a per-layer scale it does not take); use --attention-backend triton"
        )
    cfg = manifest.model
    dims = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    if dims != FLASHINFER_DIMS:
        raise MlacError(
            f"{FLAG}: FlashInfer's MLA kernels are built for kv_lora_rank {FLASHINFER_DIMS[0]} and "
            f"qk_rope_head_dim {FLASHINFER_DIMS[1]}; this model has {dims[0]} and {dims[1]}"
        )
    if manifest.plan.dp_attention:
        raise MlacError(f"{FLAG}: not with DP attention (its steps run mlac's Triton kernels)")
    import torch

    if not torch.cuda.is_available():
        raise MlacError(f"{FLAG}: CUDA is not available on this machine")
    capability = torch.cuda.get_device_capability(torch.device(options.device))
    if capability < FLASHINFER_MIN_CAPABILITY:
        got, need = ".".join(map(str, capability)), ".".join(map(str, FLASHINFER_MIN_CAPABILITY))
        raise MlacError(
            f"{FLAG}: FlashInfer's MLA kernels need compute capability {need}, this GPU has {got}"
        )
