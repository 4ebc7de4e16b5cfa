"""ModelRunner: one rank's model and KV cache tensors, running one forward step.

The Engine (and the scheduler) decide what to run: which tokens, which cache blocks. A runner
runs it. `make_runner` is the one place that decides how an artifact's ranks are run: a
1-rank artifact runs in this process; a multi-rank artifact needs one process per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mlac.artifact import Manifest
from mlac.config import ModelConfig
from mlac.errors import MlacError
from mlac.runtime.kv_cache import ForwardBatch, PagedKVCache
from mlac.runtime.layers import Weights
from mlac.runtime.loader import load_artifact
from mlac.runtime.model import DeepseekModel

DEFAULT_KV_CACHE_BYTES = 1 << 30


class ModelRunner:
    """Runs forward steps of one rank's model over its paged KV cache."""

    def __init__(self, model: DeepseekModel, cache: PagedKVCache):
        self.model = model
        self.cache = cache

    @property
    def device(self) -> torch.device:
        return self.model.embed.device

    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch, every_token: bool = False) -> torch.Tensor:
        """token_ids [T] of the batch's new tokens -> float32 logits [T, V] if every_token,
        else of each sequence's last token [B, V]."""
        hidden = self.model(token_ids, batch, self.cache)
        return self.model.logits(hidden if every_token else hidden[batch.last_token_indices])

    def close(self) -> None:
        """Release what the runner holds beyond this process (nothing for one rank)."""


def make_cache(
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    num_blocks: int | None = None,
    kv_cache_bytes: int | None = None,
    block_size: int = 16,
) -> PagedKVCache:
    """`num_blocks`, else a byte budget (default 1 GiB, capped at 4 sequences of max context)."""
    if num_blocks is None and kv_cache_bytes is not None:
        return PagedKVCache.from_budget(config, kv_cache_bytes, block_size, dtype, device)
    if num_blocks is None:
        fits = DEFAULT_KV_CACHE_BYTES // PagedKVCache.bytes_per_block(config, block_size, dtype)
        num_blocks = max(1, min(fits, -(-4 * config.max_position_embeddings // block_size)))
    return PagedKVCache(config, num_blocks, block_size, dtype, device)


@dataclass(frozen=True)
class LaunchSpec:
    """How the processes of a multi-rank artifact find each other (torch.distributed rendezvous)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


def make_runner(
    path: str | Path,
    manifest: Manifest,
    device: torch.device | str,
    dtype: torch.dtype,
    verify: bool = True,
    launch: LaunchSpec | None = None,
    **cache_args,
) -> ModelRunner:
    """The runner for an artifact: its model loaded strictly, with a fresh KV cache."""
    if manifest.plan.world_size != 1:
        raise MlacError(f"{path}: compiled for tp={manifest.plan.tp}; this runtime serves 1-rank artifacts so far")
    loaded = load_artifact(path, rank=0, device=device, dtype=dtype, verify=verify)
    model = DeepseekModel(manifest.model, Weights(loaded.tensors, source=str(path)))
    return ModelRunner(model, make_cache(manifest.model, device, dtype, **cache_args))
