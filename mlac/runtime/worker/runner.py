"""ModelRunner: one rank's model and KV cache tensors, running one forward step.

The Engine (and the scheduler) decide what to run: which tokens, which cache blocks. A runner
runs it. How a runner is built from an artifact's files is build.py; `start.make_runner` is the
one place that decides how an artifact's ranks are run (one process, or one per rank: rank 0 then
gets a distributed.DistributedRunner with ModelRunner's interface).
"""

from __future__ import annotations

import torch

from mlac.runtime.kvcache.batch import ForwardBatch
from mlac.runtime.kvcache.paged import PagedKVCache
from mlac.runtime.kvcache.pool import BlockPool
from mlac.runtime.model.dp_attention import DPRank
from mlac.runtime.model.model import DeepseekModel
from mlac.runtime.step import Step
from mlac.runtime.worker.attention_backend import TRITON, AttentionBackend
from mlac.runtime.worker.graphs import DecodeGraphs
from mlac.runtime.worker.spec_exec import Fail, Send, SpecExecutor
from mlac.runtime.worker.spec_graphs import DraftGraphs


class ModelRunner:
    """Runs forward steps of one rank's model over its paged KV cache: decode steps through the
    CUDA graphs when it has them (a batch above the largest bucket as several replays, graphs.py),
    short extends too when they fit a bucket, every other step eagerly. Under DP attention (`dp`)
    it runs its own part of every Step (dp_attention.py). `attention`: whose kernel its decode
    steps run (attention_backend.py), planned here for an eager decode step."""

    def __init__(
        self,
        model: DeepseekModel,
        cache: PagedKVCache,
        graphs: DecodeGraphs | None = None,
        startup: dict[str, float] | None = None,
        dp: DPRank | None = None,
        attention: AttentionBackend = TRITON,
    ):
        self.model = model
        self.attention = attention
        self.cache = cache
        self.graphs = graphs
        self.dp = dp
        self.pool = BlockPool(cache.num_blocks, cache.block_size)  # its blocks, as rank 0 schedules them
        # what the start cost, for the start-up log (build_runner): load_s, load_gb, graphs_s, and
        # with the overlap load_graphs_s (the wall of the two together), multi-rank ranks_met_s
        # (distributed.py)
        self.startup = startup or {}
        self.draft_graphs: DraftGraphs | None = None  # speculative decoding's MTP steps (spec_graphs.py)
        self._spec: SpecExecutor | None = None

    def spec_executor(self, send: Send | None = None, fail: Fail | None = None) -> SpecExecutor:
        """The device side of speculative decoding over this rank's runner (made once)."""
        if self._spec is None:
            self._spec = SpecExecutor(self, send, fail)
        return self._spec

    @property
    def device(self) -> torch.device:
        return self.model.device

    def run(self, step: Step) -> torch.Tensor:
        """Float32 logits of `step`: [T, V] if step.every_token, else [B, V] (each sequence's last
        new token; with CUDA graphs a view that the next step overwrites)."""
        if self.graphs is not None and self.graphs.can_run(step):  # alike on every rank
            return self.graphs.run(step)
        if self.dp is not None:
            return self.dp.run(self.model, self.cache, step)
        token_ids, batch = step.to_device(self.cache.block_size, self.device)
        return self.forward(token_ids, self.attention.eager(batch), step.every_token)

    def run_decode(self, step: Step, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [B, V] of a decode `step`, its token ids from `ids` [B] int64 on the
        device when given (else step.token_ids; in step order, under DP attention too): the CUDA
        graphs when they take it, else eager. Overlap scheduling's steps (overlap.py)."""
        if self.graphs is not None and self.graphs.can_run(step):  # alike on every rank
            return self.graphs.run(step, ids=ids)
        if self.dp is not None:
            return self.dp.run(self.model, self.cache, step, ids)
        token_ids, batch = step.to_device(self.cache.block_size, self.device)
        return self.forward(token_ids if ids is None else ids, self.attention.eager(batch))

    def forward(
        self, token_ids: torch.Tensor, batch: ForwardBatch, every_token: bool = False
    ) -> torch.Tensor:
        """token_ids [T] of the batch's new tokens -> float32 logits [T, V] if every_token,
        else of each sequence's last token [B, V]."""
        hidden = self.model(token_ids, batch, self.cache)
        return self.model.logits(hidden if every_token else hidden[batch.last_token_indices])

    @property
    def kv_pools(self) -> list[BlockPool]:
        """The KV block pools a scheduler allocates from, one per DP-attention rank: this cache's."""
        return [self.pool]

    def close(self) -> None:
        """Release what the runner holds beyond this process (nothing for one rank)."""

    def release_graphs(self) -> None:
        """Drop the CUDA graphs and their memory pool. NOTE: must run before the process group is
        destroyed: graphs that captured NCCL collectives must not outlive their communicator."""
        if self.graphs is not None or self.draft_graphs is not None:
            torch.cuda.synchronize()
            self.graphs = self.draft_graphs = None
            if self._spec is not None:
                self._spec.release_graphs()  # its chain graphs (spec_chain.py), in the same pool
