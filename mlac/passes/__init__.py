"""Passes: small pure steps over the named (lazy) tensors of one layer.

Each pass module exposes `NAME`, `run(tensors, ctx) -> tensors` and `params(ctx) -> dict`
(its manifest entry). The pipeline runs them in the fixed order of `ORDER` and owns all I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlac.core.artifact import CompileOptions
from mlac.core.config import ModelConfig


@dataclass(frozen=True)
class PassContext:
    config: ModelConfig
    options: CompileOptions
    layer: int | None  # None for the global tensors (embed, norm, head)
