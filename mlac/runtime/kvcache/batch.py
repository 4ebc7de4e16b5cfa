"""ForwardBatch: the metadata of one forward step over the paged KV cache (device tensors).

A sequence owns a block table (a list of block ids); token `p` of the sequence lives in block
`table[p // block_size]` at offset `p % block_size`, i.e. at slot `block * block_size + offset`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mlac.core.errors import MlacError
from mlac.runtime.kvcache import shared_prefix
from mlac.runtime.kvcache.shared_prefix import SharedPrefix

if TYPE_CHECKING:
    from mlac.kernels.attention.flashinfer_mla import PagedMLA


@dataclass(frozen=True)
class ForwardBatch:
    """What one model step needs besides the token ids: B sequences, their new tokens packed.

    Sequence i contributes `q_lens[i]` new tokens (packed back to back, from
    `cu_seqlens_q[i]`) after `ctx_lens[i]` tokens already in the cache; it attends to all
    `ctx_lens[i] + q_lens[i]` tokens causally. `is_decode` (every q_len == 1) selects the
    absorbed attention over the paged cache; otherwise prefill/extend runs in MHA form over the
    sequences' cached tokens, gathered by `kv_slots`. Tensor dtypes follow the kernels'
    contracts (kernels/attention/mla_decode.py, kernels/attention/extend.py). `paged_mla`: a decode
    step's FlashInfer kernel, planned for these rows by the runner's attention backend
    (worker/attention_backend.py); None: mlac's mla_decode.
    """

    is_decode: bool
    q_lens: tuple[int, ...]  # [B] new tokens per sequence
    ctx_lens: tuple[int, ...]  # [B] cached tokens per sequence before this step
    positions: torch.Tensor  # [T] int64: ctx_len + 0..q_len-1 per sequence
    slots: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0 (masked by seq_lens)
    seq_lens: torch.Tensor  # [B] int32: ctx_len + q_len
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: packed new-token offsets
    cu_seqlens_kv: torch.Tensor  # [B + 1] int32: packed offsets of all tokens (kv_slots)
    kv_slots: torch.Tensor  # [sum(seq_lens)] int64: every token's slot, per sequence (extend only)
    row_groups: torch.Tensor | None = None  # [2, B] int32: decode rows grouped per sequence (mla_decode)
    shared: SharedPrefix | None = None  # extend: cached blocks several sequences share (shared_prefix.py)
    paged_mla: PagedMLA | None = None  # decode: FlashInfer's MLA, planned for this step's rows

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def last_token_indices(self) -> torch.Tensor:
        """[B] index of each sequence's last new token in the packed tokens (where its logits are)."""
        return self.cu_seqlens_q[1:].long() - 1

    @classmethod
    def build(
        cls,
        ctx_lens: Sequence[int],
        q_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Metadata for B sequences; each table must already cover ctx_len + q_len tokens."""
        if not (len(ctx_lens) == len(q_lens) == len(block_tables)) or not q_lens:
            raise MlacError("ForwardBatch: ctx_lens, q_lens, block_tables must be non-empty, of one length")
        is_decode = all(n == 1 for n in q_lens)
        seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
        for ctx, n, table in zip(ctx_lens, q_lens, block_tables, strict=True):
            if n < 1 or ctx < 0:
                raise MlacError(f"ForwardBatch: bad sequence (ctx_len={ctx}, q_len={n})")
            if len(table) * block_size < ctx + n:
                raise MlacError(f"ForwardBatch: {len(table)} blocks cannot hold {ctx + n} tokens")

        tables = [torch.tensor(t, dtype=torch.int64) for t in block_tables]

        def slots(
            table: torch.Tensor, start: int, end: int
        ) -> torch.Tensor:  # slots of positions [start, end)
            p = torch.arange(start, end)
            return table[p // block_size] * block_size + p % block_size

        new = [slots(t, c, s) for t, c, s in zip(tables, ctx_lens, seq_lens, strict=True)]
        every = [] if is_decode else [slots(t, 0, s) for t, s in zip(tables, seq_lens, strict=True)]
        width = max(-(-s // block_size) for s in seq_lens)
        padded = [list(t[:width]) + [0] * (width - min(len(t), width)) for t in block_tables]

        def tensor(x: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=device)

        def cat(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts).to(device) if parts else tensor([])

        return cls(
            is_decode=is_decode,
            q_lens=tuple(q_lens),
            ctx_lens=tuple(ctx_lens),
            positions=cat([torch.arange(c, s) for c, s in zip(ctx_lens, seq_lens, strict=True)]),
            slots=cat(new),
            block_tables=tensor(padded, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            cu_seqlens_q=tensor(list(itertools.accumulate(q_lens, initial=0)), torch.int32),
            cu_seqlens_kv=tensor(list(itertools.accumulate(seq_lens, initial=0)), torch.int32),
            kv_slots=cat(every),
            shared=None
            if is_decode
            else shared_prefix.build(ctx_lens, q_lens, block_tables, block_size, device),
        )
