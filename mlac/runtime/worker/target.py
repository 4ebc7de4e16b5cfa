"""The GPU target this process runs on: what a compiled kernel depends on (artifact.TargetSignature)."""

from __future__ import annotations

import shutil
import subprocess

import torch

from mlac.core.units import TargetSignature


def current_target(device: torch.device | str = "cuda") -> TargetSignature | None:
    """The signature of `device` (cuda or cuda:N; "cuda" is the current GPU), or None where it is
    not a usable CUDA device (CPU: Triton compiles nothing there)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    return TargetSignature(
        gpu_name=props.name,
        compute_capability=f"{props.major}.{props.minor}",
        cuda=torch.version.cuda,
        driver=driver_version(),
        torch=torch.__version__.split("+")[0],
        triton=triton_version(),
    )


def driver_version() -> str | None:
    """The NVIDIA driver version ("570.86.15") from nvidia-smi (the same for every GPU of a host),
    or None where nvidia-smi is absent or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.strip().splitlines()
    return lines[0].strip() if lines else None


def triton_version() -> str | None:
    """The installed Triton's version (as the compiler records it in the manifest), None without Triton."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__
