"""The cached prefix that several sequences of an extend step share: found once per step.

After prefix-cache hits, the sequences of one prefill step often begin with the same cached
blocks: a system prompt that every request repeats. The plain extend attends each sequence to its
own copy of those tokens, so a step of 32 requests after a 2,000-token system prompt gathers the
prompt's latents 32 times and, in the absorbed form, scores them at 576 + 512 dims per pair.
With the shared prefix found (model/attention.extend_shared, "cascade" attention):
- the step's key/value rows are the prefix once, then every sequence's tokens past it;
- they are decompressed once into the MHA form (192 / 128 dims per pair);
- one attention launch takes each sharer over the prefix (unmasked: it precedes every new token)
  and then over its own rows (causal), each other sequence over its own rows only
  (kernels/attention/extend.py, `shared`).

The prefix is whole blocks that every sharer has cached before this step (the radix cache shares
blocks, and a sequence's new tokens may fill the rest of its last cached block). `find` takes the
sharers by their first block and keeps the largest such group, by new tokens.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedPrefix:
    """Step metadata of the cascade (module docstring); tensors on the step's device.

    length: P, the shared tokens (positions 0..P-1 of every sharer).
    sharers: the sharing sequences' indices in the step (at least two).
    num_rows: Q, the sharers' new tokens.
    rest_ctx_lens: [B] each sequence's cached tokens past the prefix (ctx_len - P for a sharer).
    sums: `step_sums` of the step, what model/attention.prefer_shared weighs (once per step, not per layer).
    kv_slots: the slots of the step's key/value rows: the prefix's P, then every sequence's
      tokens past it (all of its tokens when it does not share), packed.
    cu_seqlens_kv: [B + 1] int32, where each sequence's own rows start in them (after the P).
    shares: [B] int32, 1 for a sharer.
    """

    length: int
    sharers: tuple[int, ...]
    num_rows: int
    rest_ctx_lens: tuple[int, ...]
    sums: tuple[int, int, int]
    kv_slots: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    shares: torch.Tensor


def step_sums(
    q_lens: Sequence[int], ctx_lens: Sequence[int], rest_ctx_lens: Sequence[int]
) -> tuple[int, int, int]:
    """(keys, own keys, pairs): every sequence's tokens (cached and new), its tokens past the shared
    prefix (all of them when it does not share it), and the (new token, key) pairs of the step."""
    kv = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    own = sum(c + q for c, q in zip(rest_ctx_lens, q_lens, strict=True))
    return sum(kv), own, sum(q * n for q, n in zip(q_lens, kv, strict=True))


def find(
    ctx_lens: Sequence[int], q_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int
) -> tuple[tuple[int, ...], int] | None:
    """(sharers, blocks): the largest group (by new tokens) of two or more sequences whose cached
    tokens start with the same block, and the leading blocks that all of them have cached and
    share. None when no two sequences share a cached first block."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, (ctx, table) in enumerate(zip(ctx_lens, block_tables, strict=True)):
        if ctx >= block_size:  # at least one whole cached block
            groups[table[0]].append(i)
    best = max(
        (g for g in groups.values() if len(g) > 1), key=lambda g: sum(q_lens[i] for i in g), default=None
    )
    if best is None:
        return None
    cached = min(ctx_lens[i] // block_size for i in best)
    first = block_tables[best[0]]
    blocks = next((b for b in range(1, cached) if any(block_tables[i][b] != first[b] for i in best)), cached)
    return tuple(best), blocks


def build(
    ctx_lens: Sequence[int],
    q_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
) -> SharedPrefix | None:
    """The step's SharedPrefix, or None when no two of its sequences share a cached block."""
    found = find(ctx_lens, q_lens, block_tables, block_size)
    if found is None:
        return None
    sharers, blocks = found
    length = blocks * block_size
    share = set(sharers)
    rest_ctx = tuple(c - length if i in share else c for i, c in enumerate(ctx_lens))
    kv_lens = [c + q for c, q in zip(rest_ctx, q_lens, strict=True)]

    def slots(table: Sequence[int], start: int, end: int) -> torch.Tensor:  # positions [start, end)
        p = torch.arange(start, end)
        return torch.tensor(table, dtype=torch.int64)[p // block_size] * block_size + p % block_size

    rows = [slots(block_tables[sharers[0]], 0, length)] + [
        slots(t, length if i in share else 0, c + q)
        for i, (t, c, q) in enumerate(zip(block_tables, ctx_lens, q_lens, strict=True))
    ]
    return SharedPrefix(
        length=length,
        sharers=sharers,
        num_rows=sum(q_lens[i] for i in sharers),
        rest_ctx_lens=rest_ctx,
        sums=step_sums(q_lens, ctx_lens, rest_ctx),
        kv_slots=torch.cat(rows).to(device),
        cu_seqlens_kv=torch.tensor(
            list(itertools.accumulate(kv_lens, initial=length)), dtype=torch.int32, device=device
        ),
        shares=torch.tensor([int(i in share) for i in range(len(q_lens))], dtype=torch.int32, device=device),
    )
