"""The KV cache manager: the block pool's bookkeeping and the prefix cache over it.

A block is in exactly one of three places: free (no useful content), cached-evictable
(reference count zero but its content is registered under a prefix hash, kept in LRU order
until an allocation needs it), or referenced (owned by one or more live requests). Full blocks
are keyed by a hash chain of their tokens that starts from the tenant's salt (`prefix_salt`),
so one tenant's prompt never matches blocks another tenant computed. This module reads a
request's tokens and block table to match and register its prefix, and counts lookups and hits
for the stats; which request holds which block, and when, is the scheduler's (`scheduler.py`).

With a `window` (a model whose every layer attends only to the last `window` keys), the
blocks of a running request that no later query can see are given back as it goes
(`free_unseen`): a long generation holds about window / block_size blocks, not its whole
length. A block given back keeps its prefix-cache entry if it has one: it still holds those
tokens at those positions, so another request starting with them may take it (or the pool
evicts it like any cached block).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sluice.actors.scheduler.config import TenantConfig
from sluice.actors.scheduler.request import Request
from sluice.ipc.vocabulary import TooLongError


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of one full block: its tokens chained to every block before it."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def prefix_salt(tenant: str, limits: TenantConfig) -> bytes:
    """Where a tenant's hash chain starts: its own salt unless it opted in to sharing.

    With a salt per tenant, one tenant's prompt never matches blocks another tenant
    computed, so `cached_tokens` cannot tell a tenant what others sent.
    """
    if limits.prefix_cache_group is not None:
        return b"group:" + limits.prefix_cache_group.encode()
    if limits.share_prefix_cache:
        return b"shared"
    return b"tenant:" + tenant.encode("utf-8", "surrogatepass")


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        high_watermark: float = 1.0,
        low_watermark: float = 1.0,
        window: int = 0,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if window < 0:
            raise ValueError("window must be >= 0 (0: attention sees every key)")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.window = window  # keys a query sees back to, itself included; 0: all of them
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._cached: dict[bytes, int] = {}
        self.num_used_blocks = 0
        self.cache_queries = 0  # blocks looked up at admission
        self.cache_hits = 0
        self.high_watermark = high_watermark  # admission stops at this usage ...
        self.low_watermark = low_watermark  # ... and starts again below this one
        self.admission_open = True
        self.reserved_blocks = 0  # promised to admitted requests under reserve admission

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

    def check_fits(self, prompt_tokens: int, total_tokens: int) -> None:
        """Raise `TooLongError` unless a request could finish alone in the pool: one that cannot
        would be preempted forever."""
        pool = f"the KV pool ({self.num_total_blocks * self.block_size} tokens)"
        if self.blocks_for(prompt_tokens + 1) > self.num_total_blocks:
            raise TooLongError.about("prompt_token_ids",
                                     f"{prompt_tokens} tokens do not fit {pool}")
        if self.blocks_for(total_tokens) > self.num_total_blocks:
            raise TooLongError.about(
                "max_tokens", f"prompt + max_tokens = {total_tokens} tokens do not fit {pool}"
            )

    def may_admit(self, anyone_running: bool) -> bool:
        """Whether new requests may take KV: not past the high watermark until the pool is
        back below the low one (or nobody runs, so nothing would free blocks)."""
        if self.admission_open and self.usage >= self.high_watermark and anyone_running:
            self.admission_open = False
        elif not self.admission_open and (self.usage < self.low_watermark or not anyone_running):
            self.admission_open = True
        return self.admission_open

    # -- a request's blocks ---------------------------------------------------------------
    def can_reserve(self, request: Request) -> bool:
        """Whether the blocks for all the request may ever hold can still be promised."""
        need = self.blocks_for(request.max_total_tokens)
        return self.reserved_blocks + need <= self.num_total_blocks

    def reserve(self, request: Request) -> None:
        request.reserved_blocks = self.blocks_for(request.max_total_tokens)
        self.reserved_blocks += request.reserved_blocks

    def grow(self, request: Request, num_blocks: int) -> None:
        """Append `num_blocks` fresh blocks to the request's table."""
        request.block_ids.extend(self.allocate(num_blocks))

    def trim_to_computed(self, request: Request) -> None:
        """Give back the blocks past those the request's computed tokens fill (taken for a
        step that did not run)."""
        keep = self.blocks_for(request.num_computed_tokens)  # past its unseen blocks
        if len(request.block_ids) > keep:
            self.free(request.block_ids[keep:])
            request.block_ids = request.block_ids[:keep]  # a new list, as in `release`

    def free_unseen(self, request: Request) -> None:
        """Give back the request's blocks that no query of it will attend to again: its next
        query sits at position `num_computed_tokens` and sees keys after it less the window.
        Their table entries stay (a block's index is its place in the sequence), standing in
        with the first block it keeps: the attention kernels never read keys before a
        query's window, and a read of one would be of the request's own finite values,
        masked."""
        if not self.window:
            return
        unseen = max(0, request.num_computed_tokens - self.window + 1) // self.block_size
        unseen = min(unseen, len(request.block_ids) - 1)  # one stays, to stand in
        freed = request.num_unseen_blocks
        if unseen <= freed:
            return
        table = request.block_ids
        self.free(table[freed:unseen])
        request.block_ids = table = list(table)  # a new list: plans handed out keep theirs
        table[:unseen] = [table[unseen]] * unseen
        request.num_unseen_blocks = unseen

    def release(self, request: Request, *, free: bool = True) -> None:
        """Take the request's blocks and reservation back (`free=False`: the pool is gone)."""
        if free and request.block_ids:
            self.free(request.held_block_ids)
        request.block_ids = []  # a new list: plans already handed out keep their tables
        request.num_unseen_blocks = 0
        self.reserved_blocks -= request.reserved_blocks
        request.reserved_blocks = 0

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
        self.admission_open = True

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # -- a request's prefix ---------------------------------------------------------------
    def acquire_prefix(self, request: Request, limits: TenantConfig) -> list[int]:
        """Take a reference to each cached block the request's tokens start with.

        The last token is never matched: the step that computes it samples the next one.
        """
        if not self.enable_prefix_caching:
            return []
        hits = []
        for index in range((len(request.all_token_ids) - 1) // self.block_size):
            self.cache_queries += 1
            block = self.lookup(self.block_hash(request, index, limits))
            if block is None:
                break
            self.cache_hits += 1
            hits.append(block)
        for block in hits:
            self.acquire_cached(block)
        return hits

    def register_computed(
        self, request: Request, start: int, end: int, limits: TenantConfig
    ) -> None:
        """Tokens `start:end` of the request are in its blocks now: register the full ones."""
        size = self.block_size
        if self.enable_prefix_caching and end // size > start // size:
            for index in range(start // size, end // size):
                self.register(request.block_ids[index], self.block_hash(request, index, limits))

    def block_hash(self, request: Request, index: int, limits: TenantConfig) -> bytes:
        """The key of the request's block `index`; the chain is kept on the request."""
        hashes = request.block_hashes
        size = self.block_size
        tokens = request.all_token_ids
        while len(hashes) <= index:
            j = len(hashes)
            parent = hashes[j - 1] if j else prefix_salt(request.tenant, limits)
            hashes.append(hash_block(parent, tokens[j * size : (j + 1) * size]))
        return hashes[index]

    # -- checks and stats -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "total_blocks": self.num_total_blocks,
            "free_blocks": self.num_free_blocks,
            "cached_blocks": self.num_cached_blocks,
            "used_blocks": self.num_used_blocks,
            "usage": self.usage,
            "high_watermark": self.high_watermark,
            "low_watermark": self.low_watermark,
            "admission_open": self.admission_open,
            "block_size": self.block_size,
            "prefix_cache_hit_ratio": self.cache_hits / self.cache_queries
            if self.cache_queries
            else 0.0,
        }

    def unowned_references(self, owners: Mapping[int, int]) -> list[tuple[int, int]]:
        """(block, references) for every block referenced more often than it has owners."""
        counts = (self._ref_counts[b] - owners.get(b, 0) for b in range(self.num_total_blocks))
        return [(block, extra) for block, extra in enumerate(counts) if extra > 0]

    def ownership_problems(self, owners: Mapping[int, int]) -> list[str]:
        """How the reference counts disagree with `owners` (block -> live requests holding it)."""
        problems = []
        for block, count in owners.items():
            if self._ref_counts[block] != count:
                problems.append(
                    f"block {block} has {self._ref_counts[block]} references but {count} owners"
                )
        if sum(owners.values()) != sum(self._ref_counts):
            orphans = [b for b, c in enumerate(self._ref_counts) if c and b not in owners]
            problems.append(f"referenced blocks owned by no live request: {orphans[:8]}")
        return problems

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
            raise AssertionError("KV cache inconsistent: " + "; ".join(problems))
