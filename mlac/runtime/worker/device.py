"""The `--device` of the commands that run a model: checked once, before anything is loaded."""

from __future__ import annotations

import re

from mlac.core.errors import MlacError


def check_device(device: str | None) -> str:
    """`device` if this machine can run on it: "cpu", "cuda" or "cuda:N" with CUDA available and
    N < the number of GPUs; anything else is an MlacError that says what is accepted. None picks
    cuda when a GPU is present, else cpu. torch is imported only to ask about CUDA: `mlac serve
    --device cpu` configures its engine's process before it imports torch (cli/serve.py)."""
    if device is None:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    m = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", device)
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise MlacError(f"unknown device {device!r}: use cpu, cuda or cuda:N")
    if m.group(1) == "cpu":
        return device
    import torch

    if not torch.cuda.is_available():
        raise MlacError(f"device {device!r}: CUDA is not available on this machine (use --device cpu)")
    count = torch.cuda.device_count()
    if m.group(2) is not None and int(m.group(2)) >= count:
        raise MlacError(f"device {device!r}: this machine has {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    return device
