"""The KV cache manager's pool: allocation, reference counts, the prefix cache's LRU."""

from __future__ import annotations

import pytest

from sluice.actors.scheduler.kv_cache import KVCacheManager, hash_block


def test_allocate_and_free_return_every_block():
    bm = KVCacheManager(8, 4)
    first = bm.allocate(3)
    second = bm.allocate(5)
    assert sorted(first + second) == list(range(8))
    assert bm.num_free_blocks == 0 and bm.num_used_blocks == 8
    assert not bm.can_allocate(1)
    with pytest.raises(MemoryError):
        bm.allocate(1)
    bm.free(first)
    bm.free(second)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    bm.check_consistency()


def test_double_free_is_caught():
    bm = KVCacheManager(4, 4)
    blocks = bm.allocate(1)
    bm.free(blocks)
    with pytest.raises(AssertionError, match="not referenced"):
        bm.free(blocks)


def test_shared_block_stays_referenced_until_last_owner_frees_it():
    bm = KVCacheManager(4, 4)
    (block,) = bm.allocate(1)
    key = hash_block(None, [1, 2, 3, 4])
    bm.register(block, key)
    assert bm.lookup(key) == block
    bm.acquire_cached(block)
    assert bm.ref_count(block) == 2
    bm.free([block])
    assert bm.num_used_blocks == 1
    bm.free([block])
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 1
    bm.check_consistency()


def test_freed_cached_blocks_are_reused_by_lookup_and_evicted_least_recent_first():
    bm = KVCacheManager(3, 2)
    blocks = bm.allocate(3)
    keys = []
    parent = None
    for i, block in enumerate(blocks):
        parent = hash_block(parent, [i, i])
        keys.append(parent)
        bm.register(block, parent)
    bm.free(blocks)  # tail first: the last block becomes the least recently used
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 0
    assert bm.lookup(keys[0]) == blocks[0]
    (taken,) = bm.allocate(1)
    assert taken == blocks[2]
    assert bm.lookup(keys[2]) is None and bm.lookup(keys[0]) == blocks[0]
    bm.check_consistency()


def test_hash_chain_depends_on_every_earlier_block():
    a = hash_block(hash_block(None, [1, 2]), [3, 4])
    b = hash_block(hash_block(None, [9, 2]), [3, 4])
    assert a != b
    assert a == hash_block(hash_block(None, [1, 2]), [3, 4])


def test_duplicate_content_keeps_first_registration():
    bm = KVCacheManager(2, 2)
    x, y = bm.allocate(2)
    key = hash_block(None, [5, 6])
    bm.register(x, key)
    bm.register(y, key)
    assert bm.lookup(key) == x
    bm.free([y])
    assert bm.num_free_blocks == 1  # y had no registered content
    bm.free([x])
    assert bm.num_cached_blocks == 1
    bm.check_consistency()


def test_reset_forgets_cache_and_references():
    bm = KVCacheManager(4, 2)
    blocks = bm.allocate(2)
    bm.register(blocks[0], hash_block(None, [1, 1]))
    bm.reset()
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 0 and bm.num_cached_blocks == 0
    assert bm.lookup(hash_block(None, [1, 1])) is None
    bm.check_consistency()


def test_consistency_check_reports_a_lost_block():
    bm = KVCacheManager(4, 2)
    bm._free.pop()  # simulate a bookkeeping bug
    with pytest.raises(AssertionError, match="!= total"):
        bm.check_consistency()
