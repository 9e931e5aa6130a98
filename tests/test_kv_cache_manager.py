"""Ladder step 1: the KV cache manager with requests but no model."""

from __future__ import annotations

import pytest

from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.request import Request
from hf_paged.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], **params) -> Request:
    sp = SamplingParams(max_tokens=params.pop("max_tokens", 8), **params)
    return Request(rid, list(tokens), sp, frozenset(), len(tokens) + sp.max_tokens)


def test_allocate_grows_by_blocks_and_free_returns_them():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request("a", range(10))
    assert len(kv.allocate_slots(r, 10)) == 3
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2) == []  # fits in the third block
    r.num_computed_tokens = 12
    assert len(kv.allocate_slots(r, 1)) == 1
    assert kv.get_num_free_blocks() == 6
    kv.check_invariants()
    kv.free(r)
    assert kv.get_num_free_blocks() == 10
    kv.check_invariants()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = make_request("a", range(20))
    assert kv.allocate_slots(r, 20) is None
    assert kv.get_num_free_blocks() == 3 and not kv.req_to_blocks
    kv.check_invariants()


@pytest.mark.parametrize("prompt_len", [200, 192, 17])
def test_repeated_prompt_computes_at_most_one_block(prompt_len):
    kv = KVCacheManager(num_blocks=64, block_size=16)
    first = make_request("a", range(prompt_len))
    assert kv.get_computed_blocks(first) == ([], 0)
    kv.allocate_slots(first, prompt_len)
    first.num_computed_tokens = prompt_len  # the step ran
    kv.free(first)
    second = make_request("b", range(prompt_len))
    hits, num_hit = kv.get_computed_blocks(second)
    assert prompt_len - num_hit <= 16  # at most one block recomputed
    assert prompt_len - num_hit >= 1  # the last token is always computed
    assert kv.prefix_cache_stats.hits == num_hit
    kv.allocate_slots(second, prompt_len - num_hit, hits)
    kv.check_invariants()
    kv.free(second)
    kv.check_invariants()


def test_shared_prefix_blocks_are_shared_by_refcount():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.allocate_slots(a, 9)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [h.block_id for h in hits] == kv.get_block_ids("a")[:2]
    kv.allocate_slots(b, 2, hits)
    assert [blk.ref_cnt for blk in kv.req_to_blocks["a"][:2]] == [2, 2]
    kv.check_invariants()
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    assert kv.get_num_free_blocks() == 16


def test_prompt_logprob_requests_skip_the_cache():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", range(12))
    kv.allocate_slots(a, 12)
    kv.free(a)
    b = make_request("b", range(12), prompt_logprobs=True)
    assert kv.get_computed_blocks(b) == ([], 0)


def test_hits_from_the_free_queue_count_against_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", range(16))
    kv.allocate_slots(a, 16)
    a.num_computed_tokens = 16  # the step ran
    kv.free(a)  # 4 cached blocks, all free
    b = make_request("b", list(range(12)) + [99, 98, 97, 96, 95])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    # 3 hits leave the free queue, 2 new blocks are needed: 5 > 4 -> refused, nothing changed
    assert kv.allocate_slots(b, 5, hits) is None
    kv.check_invariants()
    assert kv.get_num_free_blocks() == 4


def test_free_unpublishes_blocks_whose_tokens_were_never_computed():
    """allocate_slots publishes the blocks a step will fill before the step runs. A request
    preempted later in the same schedule() never runs that step: freeing it must take those
    hashes out of the prefix cache, or a request with the same prefix would reuse KV that was
    never written (the random engine walk found wrong greedy tokens this way)."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request("r", range(3, 17))  # 14 tokens
    r.num_computed_tokens = 4  # its first block was computed by an earlier step
    kv.allocate_slots(r, 10)  # this step's chunk: publishes blocks 1 and 2 before the forward
    kv.free(r)  # preempted before the step ran for it
    twin = make_request("twin", list(range(3, 17)) + [5, 6])
    assert kv.get_computed_blocks(twin)[1] == 4  # block 0 only
    kv.check_invariants()
    # blocks that were computed stay shareable after a normal finish
    r2 = make_request("r2", range(3, 17))
    kv.allocate_slots(r2, 14)
    r2.num_computed_tokens = 14
    kv.free(r2)
    assert kv.get_computed_blocks(twin)[1] == 12
