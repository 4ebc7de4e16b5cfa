"""One forward step as plain host data: the one thing the scheduler, the engine and the other ranks
of a multi-rank artifact agree on.

A `Step` says which new tokens of which sequences run: sequence i runs `q_lens[i]` new tokens after
its `ctx_lens[i]` cached ones, its latents in the blocks of `block_tables[i]`. It is built once on
rank 0 (`Step.of`), sent as it is to the other ranks (step_link.send_step), and turned into device
tensors by whoever runs it: the eager path builds a ForwardBatch (`to_device`), the CUDA-graph path
writes it straight into its static buffers (graphs.py).

Under DP attention (dp_attention.py) `ranks[i]` is the rank whose KV cache holds sequence i (its
block table indexes that rank's cache); every rank receives the whole Step and runs `part(rank)`.
A Step without `ranks` runs every sequence on rank 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from mlac.core.errors import MlacError
from mlac.runtime.kvcache.batch import ForwardBatch


@dataclass(frozen=True)
class Step:
    token_ids: tuple[int, ...]  # [T] the new tokens, packed sequence after sequence
    ctx_lens: tuple[int, ...]  # [B] tokens of each sequence already in the cache
    q_lens: tuple[int, ...]  # [B] new tokens of each sequence (sum = T)
    block_tables: tuple[tuple[int, ...], ...]  # [B][blocks]: each covers ctx_len + q_len tokens
    every_token: bool = False  # logits of every new token (scoring), else of each sequence's last
    ranks: tuple[int, ...] = ()  # [B] DP attention: the rank of each sequence (empty: all on rank 0)

    @classmethod
    def of(
        cls,
        chunks: Sequence[Sequence[int]],
        ctx_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        every_token: bool = False,
        ranks: Sequence[int] = (),
    ) -> Step:
        """Sequence i runs the tokens `chunks[i]` after its `ctx_lens[i]` cached ones (on rank
        `ranks[i]` under DP attention)."""
        if not (len(chunks) == len(ctx_lens) == len(block_tables)) or not chunks:
            raise MlacError("Step: chunks, ctx_lens, block_tables must be non-empty, of one length")
        if ranks and len(ranks) != len(chunks):
            raise MlacError(f"Step: {len(ranks)} ranks for {len(chunks)} sequences")
        return cls(
            token_ids=tuple(t for c in chunks for t in c),
            ctx_lens=tuple(ctx_lens),
            q_lens=tuple(len(c) for c in chunks),
            block_tables=tuple(tuple(t) for t in block_tables),
            every_token=every_token,
            ranks=tuple(ranks),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    def rank_of(self, i: int) -> int:
        return self.ranks[i] if self.ranks else 0

    def part(self, rank: int) -> Step | None:
        """The sequences of `rank` (in step order) as a Step of their own; None when it has none."""
        mine = [i for i in range(self.num_seqs) if self.rank_of(i) == rank]
        return replace(self.select(mine), ranks=()) if mine else None

    def select(self, rows: Sequence[int]) -> Step:
        """The sequences `rows` (step indices, non-empty, in the order given) as a Step of their own,
        with their ranks."""
        if not rows:
            raise MlacError("Step.select: no sequence selected")
        starts = list(itertools.accumulate(self.q_lens, initial=0))
        return Step(
            token_ids=tuple(t for i in rows for t in self.token_ids[starts[i] : starts[i + 1]]),
            ctx_lens=tuple(self.ctx_lens[i] for i in rows),
            q_lens=tuple(self.q_lens[i] for i in rows),
            block_tables=tuple(self.block_tables[i] for i in rows),
            every_token=self.every_token,
            ranks=tuple(self.ranks[i] for i in rows) if self.ranks else (),
        )

    def rank_tokens(self, world: int) -> tuple[int, ...]:
        """[world] new tokens of each rank's sequences."""
        out = [0] * world
        for i, n in enumerate(self.q_lens):
            out[self.rank_of(i)] += n
        return tuple(out)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, logits of each: what the CUDA graphs capture."""
        return not self.every_token and all(n == 1 for n in self.q_lens)

    def to_device(self, block_size: int, device: torch.device | str) -> tuple[torch.Tensor, ForwardBatch]:
        """(token ids [T] int64, ForwardBatch) on `device`: the eager path's inputs."""
        batch = ForwardBatch.build(self.ctx_lens, self.q_lens, self.block_tables, block_size, device)
        return torch.tensor(self.token_ids, dtype=torch.int64, device=device), batch
