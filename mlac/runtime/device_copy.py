"""Short host lists onto the device without waiting for it: what every part of the runtime that
builds a small index or parameter tensor per step uses (the sampler, the penalties, the DP-attention
graphs, speculative decoding's executor). A plain torch.tensor(..., device="cuda") is a synchronous
copy from pageable memory: it waits for every kernel queued before it, which stalls a host that
should be preparing the next step while the device runs this one."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """values as a [N] tensor of `dtype` on `device`: on CUDA through pinned memory, non-blocking
    (stream-ordered: kernels queued after it see it); elsewhere a plain copy."""
    x = torch.tensor(list(values), dtype=dtype)
    device = torch.device(device)
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)
