"""Tensor- and expert-parallel layers: each rank holds its slice, and the collective is in `forward`.

The slices are the shard pass's (mlac/passes/shard.py), loaded under the 1-rank tensor names with
local shapes; nothing here slices a tensor:

    ColumnParallelLinear    W's rows (output features) split: the output stays split, no collective
    RowParallelLinear       W's columns (input features) split: partial sums, all-reduced
    VocabParallelEmbedding  rows [r·V/tp, (r+1)·V/tp): look up local ids, zero the others, all-reduce
    ParallelLMHead          rows by vocabulary: local logits, all-gathered along the vocabulary

A `ParallelContext` is fixed when the model is built. With one rank (tp == 1, group None) every
collective is the identity and each class computes exactly what its plain counterpart does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mlac.core.errors import MlacError
from mlac.runtime.model.layers import Linear, Weights


@dataclass(frozen=True)
class ParallelContext:
    """Where this rank sits: its index, the TP degree, the EP degree (1 or tp) and its process group."""

    rank: int = 0
    tp: int = 1
    ep: int = 1  # 1: every expert sliced across the ranks; tp: each rank holds E/tp whole experts
    group: dist.ProcessGroup | None = None  # None exactly when tp == 1

    def __post_init__(self) -> None:
        single = self.tp == 1
        if not 0 <= self.rank < self.tp or self.ep not in (1, self.tp) or (self.group is None) != single:
            raise MlacError(
                f"bad parallel context: rank {self.rank} tp {self.tp} ep {self.ep} group {self.group}"
            )

    def local(self, full: int, what: str) -> int:
        """This rank's share of a dimension split evenly across the TP ranks."""
        if full % self.tp:
            raise MlacError(f"tp={self.tp} does not divide {what}={full}")
        return full // self.tp


SINGLE = ParallelContext()


def all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum of `x` over the ranks (in place); the identity on one rank."""
    if ctx.group is not None:
        dist.all_reduce(x, group=ctx.group)
    return x


def all_gather_last(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """[..., n] of every rank -> [..., tp·n], rank order along the last dim; the identity on one rank."""
    if ctx.group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(ctx.tp)]
    dist.all_gather(parts, x.contiguous(), group=ctx.group)
    return torch.cat(parts, dim=-1)


class ColumnParallelLinear(Linear):
    """y_local = x @ W_local.T: this rank's output features (rows of W). No collective: the next
    layer (a RowParallelLinear, or per-head attention) consumes the split output."""

    def __init__(self, weights: Weights, name: str, ctx: ParallelContext):
        super().__init__(weights, name)
        self.ctx = ctx


class RowParallelLinear(Linear):
    """y = sum over ranks of x_local @ W_local.T: this rank's input features (columns of W).

    `reduce=False` returns the partial sum for the caller to add to other partials and reduce once
    (a MoE layer sums routed and shared experts before its one all-reduce)."""

    def __init__(self, weights: Weights, name: str, ctx: ParallelContext, reduce: bool = True):
        super().__init__(weights, name)
        self.ctx = ctx
        self.reduce = reduce

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_local] -> [..., out]
        """This rank's partial sum, not reduced (whatever `reduce` says)."""
        return super().forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_local] -> [..., out]
        y = self.partial(x)
        return all_reduce(y, self.ctx) if self.reduce else y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows [vocab_start, vocab_start + n_local_vocab) live on this rank."""

    def __init__(self, weights: Weights, name: str, vocab_size: int, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.n_local_vocab = ctx.local(vocab_size, "vocab_size")
        self.vocab_start = ctx.rank * self.n_local_vocab
        self.register_buffer("weight", weights.take(name), persistent=False)  # [V_local, D]

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        if self.ctx.tp == 1:  # every row here: one lookup, not the masked form's 9 kernels (glue table)
            # HAZARD: an id past the vocabulary is then a device-side index error, not a zero row; the
            # engine refuses such prompt ids on admission, and sampled ids come from the logits' columns.
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        inside = (local >= 0) & (local < self.n_local_vocab)  # [T]: ids this rank holds
        x = F.embedding(local.masked_fill(~inside, 0), self.weight)
        return all_reduce(x.masked_fill(~inside[:, None], 0), self.ctx)  # exactly one rank adds each row


class ParallelLMHead(Linear):
    """Logits of this rank's vocabulary rows, all-gathered along the vocabulary to [N, V] on every rank."""

    def __init__(self, weights: Weights, name: str, ctx: ParallelContext):
        super().__init__(weights, name)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V]
        return all_gather_last(super().forward(x), self.ctx)
