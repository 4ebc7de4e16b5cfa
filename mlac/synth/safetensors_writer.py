"""Stream random weights into safetensors files without holding a shard in memory.

The header is known before any data (shapes and dtypes come from the config), so each file is
written header first, then chunk by chunk at its final offset with pwrite. Memory stays at a few
chunks (tens of MB) whatever the shard size. Tensors are laid out as the safetensors library lays
them out (widest dtype first, then by name), so every tensor starts aligned to its item size.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from mlac.core.safetensors_io import encode_header
from mlac.synth.weights import Param, draw_chunk

Progress = Callable[[int], None]


def plan_shards(params: list[Param], max_shard_bytes: int) -> list[list[Param]]:
    """Group params, in order, into shards of at most max_shard_bytes (a bigger one sits alone).

    A weight and its FP8 scale always share a shard.
    """
    shards: list[list[Param]] = [[]]
    size = 0
    for p in params:
        if shards[-1] and size + p.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def _layout(params: list[Param]) -> tuple[bytes, dict[str, int]]:
    """(header bytes incl. the 8-byte length, data offset of each stored tensor)."""
    stored = [t for p in params for t in p.stored()]
    stored.sort(key=lambda t: (-t[1].itemsize, t[0]))
    header, offsets = encode_header(stored)
    return header, {name: off for (name, _, _), off in zip(stored, offsets, strict=True)}


def _pwrite_all(fd: int, data: torch.Tensor, offset: int) -> int:
    buf = memoryview(data.contiguous().view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)
    return done


Job = tuple[Param, int, bool, Future]  # param, first row, last chunk of the param?, draw_chunk


def _jobs(params: list[Param], seed: int, pool: ThreadPoolExecutor, depth: int) -> Iterator[Job]:
    """The chunks of `params` in order, drawn ahead by the pool, at most `depth` in flight."""
    pending: deque[Job] = deque()
    for p in params:
        chunks = p.chunks()
        for k, (start, stop) in enumerate(chunks):
            last = k == len(chunks) - 1
            pending.append((p, start, last, pool.submit(draw_chunk, p, seed, k, stop - start)))
            if len(pending) >= depth:
                yield pending.popleft()
    yield from pending


def write_shard(
    path: Path,
    params: list[Param],
    seed: int,
    pool: ThreadPoolExecutor,
    depth: int,
    progress: Progress | None,
) -> None:
    """Write one safetensors file holding `params` (and their FP8 scales), `depth` chunks ahead."""
    header, offsets = _layout(params)
    base = len(header)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header, 0)
        scales: list[torch.Tensor] = []
        for p, start, last, fut in _jobs(params, seed, pool, depth):
            rows, scale = fut.result()
            row_bytes = math.prod(p.shape[1:]) * p.dtype.itemsize
            n = _pwrite_all(fd, rows, base + offsets[p.name] + start * row_bytes)
            if scale is not None:
                scales.append(scale)  # [rows/128, cols/128] each
            if last and scales:
                n += _pwrite_all(fd, torch.cat(scales), base + offsets[p.scale_name])
                scales = []
            if progress is not None:
                progress(n)
    finally:
        os.close(fd)
