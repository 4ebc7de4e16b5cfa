"""Lazy tensors: what passes hand to each other, so that no pass ever holds a whole layer.

A LazyTensor knows its shape and dtype and how to produce its data. A tensor built by
concatenating others along dim 0 (fused projections, stacked experts) keeps its parts, so the
writer streams it part by part: peak memory is one source tensor, not one layer (a V3 MoE layer
is 11 GB). Everything else is materialized one tensor at a time, on demand, and not cached.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class LazyTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor] | None = None  # materializes the whole tensor
    parts: tuple[LazyTensor, ...] = ()  # or: the dim-0 concatenation of these

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def load(self) -> torch.Tensor:
        if self.parts:
            return torch.cat([p.load().reshape(-1) for p in self.parts]).view(self.shape)
        assert self.produce is not None
        t = self.produce()
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise AssertionError(
                f"lazy tensor produced {tuple(t.shape)} {t.dtype}, declared {self.shape} {self.dtype}"
            )
        return t

    def chunks(self) -> Iterator[torch.Tensor]:
        """Pieces whose bytes, concatenated, are this tensor's bytes (row-major)."""
        if self.parts:
            for p in self.parts:
                yield from p.chunks()
        else:
            yield self.load()

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], shape=None, dtype=None) -> LazyTensor:
        """A tensor computed from this one when needed."""
        return LazyTensor(tuple(shape or self.shape), dtype or self.dtype, lambda: fn(self.load()))


def eager(t: torch.Tensor) -> LazyTensor:
    return LazyTensor(tuple(t.shape), t.dtype, lambda: t)


def concat_rows(parts: list[LazyTensor]) -> LazyTensor:
    """Concatenate along dim 0 without materializing (all parts share trailing dims and dtype)."""
    tail, dtype = parts[0].shape[1:], parts[0].dtype
    for p in parts:
        if p.shape[1:] != tail or p.dtype != dtype:
            raise AssertionError(f"cannot concatenate {p.shape} {p.dtype} onto {parts[0].shape} {dtype}")
    return LazyTensor((sum(p.shape[0] for p in parts), *tail), dtype, parts=tuple(parts))


def stack(parts: list[LazyTensor]) -> LazyTensor:
    """Stack along a new dim 0 without materializing."""
    shape, dtype = parts[0].shape, parts[0].dtype
    for p in parts:
        if p.shape != shape or p.dtype != dtype:
            raise AssertionError(f"cannot stack {p.shape} {p.dtype} with {shape} {dtype}")
    return LazyTensor((len(parts), *shape), dtype, parts=tuple(parts))


def _rebuild(t: LazyTensor, parts: list[LazyTensor]) -> LazyTensor:
    stacked = len(t.parts[0].shape) == len(t.shape) - 1
    return stack(parts) if stacked else concat_rows(parts)


def take_rows(t: LazyTensor, a: int, b: int) -> LazyTensor:
    """t[a:b] along dim 0, touching only the parts that overlap [a, b)."""
    if (a, b) == (0, t.shape[0]):
        return t
    if not t.parts:
        return LazyTensor((b - a, *t.shape[1:]), t.dtype, lambda: t.load()[a:b].contiguous())
    stacked = len(t.parts[0].shape) == len(t.shape) - 1
    pieces, off = [], 0
    for p in t.parts:
        n = 1 if stacked else p.shape[0]
        lo, hi = max(a, off), min(b, off + n)
        if lo < hi:
            pieces.append(p if stacked else take_rows(p, lo - off, hi - off))
        off += n
    return _rebuild(t, pieces)


def take_cols(t: LazyTensor, a: int, b: int) -> LazyTensor:
    """t[..., a:b] along the last dim, part by part."""
    if (a, b) == (0, t.shape[-1]):
        return t
    if t.parts:
        return _rebuild(t, [take_cols(p, a, b) for p in t.parts])
    return LazyTensor((*t.shape[:-1], b - a), t.dtype, lambda: t.load()[..., a:b].contiguous())


def per_part(t: LazyTensor, fn: Callable[[LazyTensor], LazyTensor]) -> LazyTensor:
    """Apply fn to every part of a stacked tensor (one expert at a time)."""
    assert t.parts and len(t.parts[0].shape) == len(t.shape) - 1, "per_part needs a stacked tensor"
    return stack([fn(p) for p in t.parts])
