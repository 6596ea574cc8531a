"""The KV block pool's bookkeeping: reference counts, the free list and the prefix cache.

A block is in exactly one of three places: free (no useful content), cached-evictable
(reference count zero but its content is registered under a prefix hash, kept in LRU order
until an allocation needs it), or referenced (owned by one or more live requests). This module
knows nothing of requests; the scheduler core decides who owns which block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of one full block: its tokens chained to every block before it."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._cached: dict[bytes, int] = {}
        self.num_used_blocks = 0
        self.cache_queries = 0  # blocks looked up at admission
        self.cache_hits = 0

    # -- sizes ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no content worth keeping."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for the prefix cache; an allocation may evict them."""
        return len(self._evictable)

    @property
    def num_available_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation -----------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free) + len(self._evictable)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks with reference count one; free ones before cached ones."""
        if not self.can_allocate(num_blocks):
            raise MemoryError(
                f"KV pool exhausted: {num_blocks} blocks wanted, {self.num_available_blocks} left"
            )
        blocks = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._cached[self._block_hash[block]]
                self._block_hash[block] = None
            self._ref_counts[block] = 1
            blocks.append(block)
        self.num_used_blocks += num_blocks
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; pass them in table order.

        Blocks are released last-first, so that when the cache must give blocks up it takes a
        sequence's tail before its (more widely shared) head.
        """
        for block in reversed(list(blocks)):
            count = self._ref_counts[block]
            if count <= 0:
                raise AssertionError(f"block {block} freed while not referenced")
            count -= 1
            self._ref_counts[block] = count
            if count == 0:
                self.num_used_blocks -= 1
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # -- prefix cache ---------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def acquire_cached(self, block: int) -> None:
        """Take a reference to a block found by `lookup`."""
        if self._ref_counts[block] == 0:
            del self._evictable[block]
            self.num_used_blocks += 1
        self._ref_counts[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """Record that a referenced block now holds the full block keyed by `block_hash`.

        When the same content is already cached in another block (two requests computed the
        same prefix at once), this block stays unregistered and is simply freed later.
        """
        if not self.enable_prefix_caching or self._block_hash[block] is not None:
            return
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            self._block_hash[block] = block_hash

    def reset(self) -> None:
        """Forget everything: the pool's content is gone (the worker was lost)."""
        n = self.num_total_blocks
        self._ref_counts = [0] * n
        self._block_hash = [None] * n
        self._free = deque(range(n))
        self._evictable.clear()
        self._cached.clear()
        self.num_used_blocks = 0

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # -- checks ---------------------------------------------------------------------------
    def check_consistency(self) -> None:
        """Raise AssertionError naming the first broken rule of the pool's bookkeeping."""
        n = self.num_total_blocks
        free = set(self._free)
        evictable = set(self._evictable)
        problems = []
        if len(free) != len(self._free):
            problems.append("a block is on the free list twice")
        if free & evictable:
            problems.append(f"blocks both free and cached: {sorted(free & evictable)[:8]}")
        referenced = {b for b in range(n) if self._ref_counts[b] > 0}
        if any(c < 0 for c in self._ref_counts):
            problems.append("negative reference count")
        if referenced & (free | evictable):
            problems.append(
                f"referenced blocks on a free list: {sorted(referenced & (free | evictable))[:8]}"
            )
        total = len(free) + len(evictable) + len(referenced)
        if total != n:
            lost = sorted(set(range(n)) - free - evictable - referenced)[:8]
            problems.append(
                f"free {len(free)} + cached {len(evictable)} + referenced {len(referenced)} "
                f"!= total {n} (unaccounted: {lost})"
            )
        if self.num_used_blocks != len(referenced):
            problems.append(f"used counter {self.num_used_blocks} != referenced {len(referenced)}")
        for block in evictable:
            if self._block_hash[block] is None:
                problems.append(f"cached block {block} has no hash")
                break
        for block in free:
            if self._block_hash[block] is not None:
                problems.append(f"free block {block} still has a hash")
                break
        for block_hash, block in self._cached.items():
            if self._block_hash[block] != block_hash:
                problems.append(f"cache index points at block {block} with other content")
                break
        if problems:
            raise AssertionError("block manager inconsistent: " + "; ".join(problems))
