"""Ladder step 1: the block pool on its own."""

from __future__ import annotations

import pytest

from hf_paged.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens


def test_free_queue_is_fifo_with_o1_removal_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.num_free_blocks == 5
    q.remove(blocks[2])
    assert list(q.block_ids()) == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert list(q.block_ids()) == [1, 3, 4, 2]
    assert q.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])  # not in the queue


def test_popleft_on_empty_queue_raises():
    q = FreeBlockQueue([])
    with pytest.raises(RuntimeError):
        q.popleft()


def test_allocate_free_refcounts_and_lru_order():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)
    assert pool.get_num_free_blocks() == 2
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([b, a])
    assert a.ref_cnt == 1 and b.ref_cnt == 0
    # the free queue order is the eviction order: never-used blocks 2,3 first, then b
    assert list(pool.free_block_queue.block_ids()) == [2, 3, b.block_id]
    assert [x.block_id for x in pool.blocks] == [0, 1]  # blocks 2, 3 not made yet
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])  # double free
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(5)


def test_cached_block_survives_free_until_reused_then_is_evicted():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_block(block, h)
    pool.free_blocks([block])
    assert pool.get_cached_block(h) is block  # still a hit while free
    pool.touch([block])  # a hit takes it back out of the free queue
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks([block])
    pool.get_new_blocks(2)  # reuse both: the cached one is evicted
    assert pool.get_cached_block(h) is None and block.block_hash is None
    assert pool.num_evictions == 1


def test_hash_chain_depends_on_parent_and_extra_keys():
    a = hash_block_tokens(None, [1, 2])
    b = hash_block_tokens(a, [3, 4])
    assert b != hash_block_tokens(None, [3, 4])
    assert b == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])
    assert hash_block_tokens(None, [1, 2], ("adapter", 1)) != a


def test_duplicate_contents_keep_first_cached_copy():
    pool = BlockPool(2)
    x, y = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [5, 6])
    pool.cache_full_block(x, h)
    pool.cache_full_block(y, h)
    assert pool.get_cached_block(h) is x and y.block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, hash_block_tokens(None, [1]))
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache() and not pool.cached_blocks


def test_blocks_are_made_when_first_handed_out():
    """A large cache's pool builds no block objects up front (start-up time), and hands out the
    never-used blocks first, in id order, before any freed one."""
    pool = BlockPool(10**6)
    assert pool.blocks == [] and pool.get_num_free_blocks() == 10**6
    a, b, c = pool.get_new_blocks(3)
    assert [x.block_id for x in (a, b, c)] == [0, 1, 2] and pool.blocks == [a, b, c]
    pool.free_blocks([b])
    (d,) = pool.get_new_blocks(1)
    assert d.block_id == 3  # unused blocks before the freed one
    assert pool.get_num_free_blocks() == 10**6 - 3
