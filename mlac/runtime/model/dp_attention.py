"""DP attention: each rank of a multi-rank artifact runs attention for its own requests, over its
own KV cache, and the MLPs and MoE stay sharded over all ranks.

In a plain `--tp N` artifact the latent projections are replicated, so every rank caches the same
latents and the KV cache is stored N times. An artifact compiled with `--dp-attention` keeps the
attention weights whole on every rank (passes/shard.py; recorded as `plan.dp_attention`), and:

    rank 0's scheduler   assigns each request to a rank when admitting it (`route`: the rank with
                         the most free KV blocks), keeps one BlockAllocator and prefix cache per
                         rank (`BlockPool` for ranks > 0: bookkeeping only, the tensors live on
                         that rank), and builds one Step whose `ranks` say where each sequence is
    every rank           receives the whole Step and embeds every rank's tokens (the embedding is
                         vocab-parallel: all-reduced), keeps its own rows, runs attention over
                         its own sequences only (none: an idle rank skips attention, yet joins
                         every collective), then per layer:
    TokenExchange        gathers the ranks' hidden states before the MLP / MoE (ragged: padded to
                         the step's largest rank; even, as in a CUDA graph's bucket: the collective
                         alone; every rank knows every count from the Step, so no collective is
                         spent on counts), runs the sharded MLP / MoE over all
                         tokens, and reduce-scatters the partial sums back to each rank's tokens
    logits               each rank's sampled rows are gathered the same way; the vocab-parallel
                         head then gives every rank the logits of every sequence, in step order

Prefix cache: matching happens within the chosen rank (a rank's cached blocks are in its own
cache); the route prefers the rank holding the request's longest cached prefix when that rank
has room for the rest, else the rank with the most free blocks.

Decode steps and short extends replay CUDA graphs of rows per rank (dp_graphs.py); other steps run
eagerly here. Under overlap scheduling a decode step's token ids come on the device in step order
(rank 0's sampled ids, broadcast): each rank puts them in rank order itself (`rank_order`), from the
Step it holds, so no rank waits on the host for them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlac.runtime.device_copy import to_device
from mlac.runtime.kvcache.paged import PagedKVCache
from mlac.runtime.step import Step

# torch >= 2.12 renamed these (same signatures); 2.11 has only the old name
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TokenExchange:
    """One step's rows per rank (`counts`), and this rank's place among them.

    `gather`: this rank's rows [counts[rank], D] -> every rank's [sum(counts), D], rank order.
    `scatter`: partial sums over all rows [sum(counts), D] -> this rank's rows, summed over ranks.
    """

    counts: tuple[int, ...]
    rank: int
    group: dist.ProcessGroup | None

    @property
    def start(self) -> int:
        return sum(self.counts[: self.rank])

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows [sum(counts), ...] -> this rank's."""
        return x[self.start : self.start + self.counts[self.rank]]

    @property
    def even(self) -> bool:
        """Every rank has as many rows (a CUDA graph's bucket): no padding, no reordering."""
        return len(set(self.counts)) == 1

    def gather(self, x: torch.Tensor) -> torch.Tensor:  # [n_rank, D] -> [sum(counts), D]
        m, size = max(self.counts), len(self.counts)
        if self.even:  # the collective alone: rank r's rows land at r·m, as the padded path's cat puts them
            out = x.new_empty(size * m, x.shape[1])
            _all_gather(out, x.contiguous(), group=self.group)
            return out
        padded = x.new_zeros(m, x.shape[1])
        padded[: x.shape[0]] = x
        out = x.new_empty(size * m, x.shape[1])  # [size·m, D]: rank r's rows at r·m
        _all_gather(out, padded, group=self.group)
        return torch.cat([out[r * m : r * m + n] for r, n in enumerate(self.counts)])

    def scatter(self, y: torch.Tensor) -> torch.Tensor:  # [sum(counts), D] -> [n_rank, D]
        m, size = max(self.counts), len(self.counts)
        if self.even:  # y is already [size·m, D] in rank order: the collective alone
            out = y.new_empty(m, y.shape[1])
            _reduce_scatter(out, y.contiguous(), group=self.group)
            return out
        padded = y.new_zeros(size, m, y.shape[1])
        starts = list(itertools.accumulate(self.counts, initial=0))
        for r, n in enumerate(self.counts):
            padded[r, :n] = y[starts[r] : starts[r] + n]
        out = y.new_empty(m, y.shape[1])
        _reduce_scatter(out, padded.view(size * m, -1), group=self.group)
        return out[: self.counts[self.rank]]


@dataclass(frozen=True)
class DPRank:
    """This rank's place in a DP-attention world: it runs the whole Step's `part(rank)`."""

    rank: int
    size: int
    group: dist.ProcessGroup | None

    def run(self, model, cache: PagedKVCache, step: Step, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits of the whole `step` ([T, V] if every_token, else [B, V], step order) on
        every rank; this rank ran attention for its own sequences only. `ids`: a decode step's
        token ids [B] on the device, in step order (overlap scheduling), else step.token_ids."""
        parts = [step.part(r) for r in range(self.size)]
        mine = parts[self.rank]
        if ids is None:
            host = [t for p in parts if p is not None for t in p.token_ids]  # [T] in rank order
            token_ids = to_device(host, torch.int64, model.device)
        else:  # one token per sequence: the sequences of rank 0, then rank 1's, ...
            token_ids = ids.index_select(0, to_device(rank_order(step, self.size), torch.int64, ids.device))
        batch = mine.to_device(cache.block_size, model.device)[1] if mine is not None else None
        hidden = model(
            token_ids, batch, cache, TokenExchange(step.rank_tokens(self.size), self.rank, self.group)
        )
        if batch is not None and not step.every_token:
            hidden = hidden[batch.last_token_indices]  # [B_rank, D]
        rows = rows_per_rank(step, self.size)
        gathered = TokenExchange(tuple(map(len, rows)), self.rank, self.group).gather(hidden)
        logits = model.logits(gathered)  # [N, V], rows in rank order
        order = to_device([i for r in rows for i in r], torch.int64, logits.device)
        return torch.empty_like(logits).index_copy_(0, order, logits)  # step order


def rank_order(step: Step, size: int) -> list[int]:
    """The step's sequences ordered by rank (rank 0's first), each rank's in step order."""
    return [i for r in range(size) for i in range(step.num_seqs) if step.rank_of(i) == r]


def rows_per_rank(step: Step, size: int) -> list[list[int]]:
    """For each rank, the step's logits rows it produces, in step order: token indices if
    every_token, else sequence indices."""
    out: list[list[int]] = [[] for _ in range(size)]
    starts = list(itertools.accumulate(step.q_lens, initial=0))
    for i in range(step.num_seqs):
        r = step.rank_of(i)
        out[r] += range(starts[i], starts[i + 1]) if step.every_token else [i]
    return out
