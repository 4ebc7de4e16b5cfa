"""One forward step as plain host data: the one thing the scheduler, the engine and the other ranks
of a multi-rank artifact agree on.

A `Step` says which new tokens of which sequences run: sequence i runs `q_lens[i]` new tokens after
its `ctx_lens[i]` cached ones, its latents in the blocks of `block_tables[i]`. It is built once on
rank 0 (`Step.of`), sent as it is to the other ranks (dist.send_step), and turned into device
tensors by whoever runs it: the eager path builds a ForwardBatch (`to_device`), the CUDA-graph path
writes it straight into its static buffers (graphs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlac.errors import MlacError
from mlac.runtime.kv_cache import ForwardBatch


@dataclass(frozen=True)
class Step:
    token_ids: tuple[int, ...]  # [T] the new tokens, packed sequence after sequence
    ctx_lens: tuple[int, ...]  # [B] tokens of each sequence already in the cache
    q_lens: tuple[int, ...]  # [B] new tokens of each sequence (sum = T)
    block_tables: tuple[tuple[int, ...], ...]  # [B][blocks]: each covers ctx_len + q_len tokens
    every_token: bool = False  # logits of every new token (scoring), else of each sequence's last

    @classmethod
    def of(
        cls,
        chunks: Sequence[Sequence[int]],
        ctx_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        every_token: bool = False,
    ) -> Step:
        """Sequence i runs the tokens `chunks[i]` after its `ctx_lens[i]` cached ones."""
        if not (len(chunks) == len(ctx_lens) == len(block_tables)) or not chunks:
            raise MlacError("Step: chunks, ctx_lens, block_tables must be non-empty, of one length")
        return cls(
            token_ids=tuple(t for c in chunks for t in c),
            ctx_lens=tuple(ctx_lens),
            q_lens=tuple(len(c) for c in chunks),
            block_tables=tuple(tuple(t) for t in block_tables),
            every_token=every_token,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, logits of each: what the CUDA graphs capture."""
        return not self.every_token and all(n == 1 for n in self.q_lens)

    def to_device(self, block_size: int, device: torch.device | str) -> tuple[torch.Tensor, ForwardBatch]:
        """(token ids [T] int64, ForwardBatch) on `device`: the eager path's inputs."""
        batch = ForwardBatch.build(self.ctx_lens, self.q_lens, self.block_tables, block_size, device)
        return torch.tensor(self.token_ids, dtype=torch.int64, device=device), batch
