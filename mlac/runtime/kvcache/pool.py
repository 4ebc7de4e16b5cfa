"""BlockPool: rank 0's bookkeeping of one KV cache's blocks: its allocator and its radix prefix
tree. The tensors live on the rank that holds the cache (paged.PagedKVCache); rank 0 keeps one
pool per cache it schedules over: its own, and under DP attention one per other rank too."""

from __future__ import annotations

from mlac.runtime.kvcache.blocks import BlockAllocator
from mlac.runtime.kvcache.radix import PrefixCache


class BlockPool:
    """The allocator and prefix cache of a cache of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.prefix = PrefixCache(self.allocator)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size
