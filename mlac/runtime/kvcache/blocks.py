"""The block allocator of a paged KV cache: a free list of block ids of `block_size` tokens.

table = []
allocator.reserve(table, n_tokens)   # before a step: grow the sequence's table (all or nothing)
allocator.free(table)                # when it ends
"""

from __future__ import annotations

from collections.abc import Sequence

from mlac.core.errors import MlacError


class BlockAllocator:
    """Free list of block ids [0, num_blocks) of `block_size` tokens. Freed blocks are reused first.

    With a prefix cache attached (`reclaimer`, see radix.py), blocks it holds that no
    sequence uses count as free: `alloc` evicts them (least recently used first) when the free
    list runs short. `num_unused` is the free list alone.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise MlacError(
                f"KV cache needs at least one block of one token (got {num_blocks} x {block_size})"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._used: set[int] = set()
        self.reclaimer = None  # a PrefixCache: num_evictable, evict(n)

    @property
    def num_unused(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_free(self) -> int:
        """Blocks `alloc` can hand out: the free list and the evictable cached blocks."""
        return len(self._free) + (self.reclaimer.num_evictable if self.reclaimer is not None else 0)

    def free_list(self) -> list[int]:
        """The block ids on the free list (a copy)."""
        return list(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free) and self.reclaimer is not None:
            self.reclaimer.evict(n - len(self._free))
        if n > len(self._free):
            raise MlacError(
                f"KV cache full: {n} block(s) wanted, {len(self._free)} free of {self.num_blocks}"
            )
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise MlacError(f"block {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reserve(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` in place until it covers `num_tokens` tokens (all or nothing)."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > 0:
            table.extend(self.alloc(need))
