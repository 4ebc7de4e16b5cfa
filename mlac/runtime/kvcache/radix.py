"""Radix prefix cache: full KV blocks shared between requests by their token ids.

The tree is keyed at block granularity: a node holds one block of `block_size` token ids (its key)
and the block id whose latents those tokens wrote, given the whole path from the root before it.
Only FULL, computed blocks enter the tree, and a block in the tree is never written again.

    node = cache.match(tokens, max_blocks)   # longest cached prefix; takes a reference on its path
    table = cache.blocks(node) + private     # the prefix's blocks head the sequence's table
    node, dup = cache.insert_running(node, prompt, table)  # its prompt computed: shared from now on
    leftover = cache.insert(node, computed_tokens, table)  # at finish / abort / preemption
    allocator.free(leftover)                 # blocks the tree did not take (partial, duplicates)

Each node counts the sequences that use it (`refs`); a sequence references its whole path, so a
node's refs are at least its children's. Unreferenced nodes stay cached until evicted: `evict(n)`
frees least-recently-used unreferenced leaves. The allocator calls it when its free list runs
short (BlockAllocator.reclaimer), so eviction always comes before any preemption.

Block accounting (checked by Scheduler.check_blocks): the allocator's free list, the tree's
unreferenced blocks and the blocks in sequences' tables are disjoint and cover every block.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlac.runtime.kvcache.blocks import BlockAllocator


class Node:
    """One cached block: `key` (its block_size token ids) after its parent's path."""

    __slots__ = ("parent", "key", "block", "children", "refs", "last_used", "depth")

    def __init__(self, parent: Node | None, key: tuple[int, ...], block: int, last_used: int):
        self.parent = parent
        self.key = key
        self.block = block
        self.children: dict[tuple[int, ...], Node] = {}
        self.refs = 0
        self.last_used = last_used
        self.depth = parent.depth + 1 if parent is not None else 0  # blocks on the path, self included


class PrefixCache:
    """The radix tree over one allocator's blocks. Tree blocks stay allocated (in the allocator's
    used set) until evicted; `num_evictable` of them are referenced by no sequence."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.root = Node(None, (), -1, 0)
        self.num_evictable = 0  # nodes with refs == 0
        self._clock = 0  # LRU time: bumped on every match and insert
        allocator.reclaimer = self

    # ---- lookups -----------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], max_blocks: int) -> Node:
        """The deepest node whose path is a prefix of `tokens`, at most `max_blocks` deep; takes a
        reference on its path (give it back with `release` or `insert`). The root when none."""
        node, bs = self.root, self.block_size
        for i in range(min(max_blocks, len(tokens) // bs)):
            child = node.children.get(tuple(tokens[i * bs : (i + 1) * bs]))
            if child is None:
                break
            node = child
        self._acquire(node)
        return node

    @staticmethod
    def blocks(node: Node) -> list[int]:
        """The block ids of the path root -> node, in token order."""
        out = []
        while node.parent is not None:
            out.append(node.block)
            node = node.parent
        return out[::-1]

    def nodes(self) -> Iterator[Node]:
        """Every cached node (the root excluded)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- references --------------------------------------------------------------------------

    def _acquire(self, node: Node) -> None:
        self._clock += 1
        while node.parent is not None:
            self.num_evictable -= node.refs == 0
            node.refs += 1
            node.last_used = self._clock
            node = node.parent

    def release(self, node: Node) -> None:
        """Drop one sequence's reference on the path root -> node."""
        while node.parent is not None:
            node.refs -= 1
            self.num_evictable += node.refs == 0
            node = node.parent

    def insert(self, node: Node, tokens: Sequence[int], table: Sequence[int]) -> list[int]:
        """A sequence leaves: its full blocks of computed `tokens` join the tree after its matched
        `node` (whose path heads `table`), and its reference on `node` is dropped. Returns the
        blocks of `table` the tree did not take (a partial last block, blocks whose tokens were
        cached meanwhile by another sequence): the caller frees them."""
        _, twice = self._add_path(node, tokens, table)
        self.release(node)
        return [table[i] for i, _ in twice] + list(table[max(node.depth, len(tokens) // self.block_size) :])

    def insert_running(self, node: Node, tokens: Sequence[int], table: list[int]) -> tuple[Node, list[int]]:
        """A sequence that keeps running (its prompt just computed): its full blocks of `tokens`
        join the tree after its matched `node` and its reference moves to the deepest of them, so
        that requests admitted from now on share them. A block whose tokens another sequence cached
        meanwhile is replaced in `table` (in place) by the cached one. Returns (the new node, the
        blocks of `table` replaced so: the caller frees them)."""
        at, twice = self._add_path(node, tokens, table)
        replaced = [table[i] for i, _ in twice]
        for i, cached in twice:
            table[i] = cached
        self._acquire(at)
        self.release(node)
        return at, replaced

    def _add_path(self, node: Node, tokens: Sequence[int], table: Sequence[int]) -> tuple[Node, list]:
        """Add the full blocks of `tokens` past `node` (blocks from `table`) as nodes, unreferenced.
        Returns (the deepest node, [(i, cached block)] where block i's tokens were cached already,
        with another block: the same tokens computed twice, the cached copy stays)."""
        bs, at, twice = self.block_size, node, []
        self._clock += 1
        for i in range(node.depth, len(tokens) // bs):
            key = tuple(tokens[i * bs : (i + 1) * bs])
            child = at.children.get(key)
            if child is None:
                child = at.children[key] = Node(at, key, table[i], self._clock)
                self.num_evictable += 1
            elif child.block != table[i]:
                twice.append((i, child.block))
            child.last_used = self._clock
            at = child
        return at, twice

    # ---- eviction ----------------------------------------------------------------------------

    def evict(self, n: int) -> int:
        """Free up to `n` unreferenced blocks, least recently used leaves first; returns how many."""
        if n <= 0 or self.num_evictable == 0:
            return 0
        heap = [(x.last_used, x.block, x) for x in self.nodes() if x.refs == 0 and not x.children]
        heapq.heapify(heap)
        freed = []
        while heap and len(freed) < n:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            freed.append(node.block)
            if parent.parent is not None and parent.refs == 0 and not parent.children:
                heapq.heappush(heap, (parent.last_used, parent.block, parent))
        self.num_evictable -= len(freed)
        self.allocator.free(freed)
        return len(freed)

    def clear(self) -> int:
        """Evict every unreferenced block (returns how many)."""
        return self.evict(self.num_evictable)
