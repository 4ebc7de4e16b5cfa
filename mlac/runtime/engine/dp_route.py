"""DP attention's placement: which rank's KV cache a new request runs in (model/dp_attention.py)."""

from __future__ import annotations

from collections.abc import Sequence

from mlac.runtime.kvcache.pool import BlockPool
from mlac.runtime.kvcache.radix import PrefixCache


def route(pools: Sequence[BlockPool], tokens: Sequence[int], need_blocks: int, use_prefix: bool) -> int:
    """The rank (index into `pools`) a new request of `tokens` runs on: the one holding its longest
    cached prefix if it has `need_blocks` (its first chunk's, prefix included) free, else the one
    with the most free blocks (the lowest rank on a tie)."""
    free = [p.allocator.num_free for p in pools]
    most_free = max(range(len(pools)), key=lambda r: (free[r], -r))
    if not use_prefix:
        return most_free
    bs, max_blocks = pools[0].block_size, (len(tokens) - 1) // pools[0].block_size
    depth = [cached_blocks(p.prefix, tokens, max_blocks, bs) for p in pools]
    best = max(range(len(pools)), key=lambda r: (depth[r], free[r], -r))
    # free counts the matched blocks too while no sequence holds them (evictable): need them all
    return best if depth[best] and need_blocks <= free[best] else most_free


def cached_blocks(prefix: PrefixCache, tokens: Sequence[int], max_blocks: int, block_size: int) -> int:
    """How many leading full blocks of `tokens` `prefix` holds (a lookup only: no reference taken)."""
    node, n = prefix.root, 0
    while n < min(max_blocks, len(tokens) // block_size):
        node = node.children.get(tuple(tokens[n * block_size : (n + 1) * block_size]))
        if node is None:
            break
        n += 1
    return n
