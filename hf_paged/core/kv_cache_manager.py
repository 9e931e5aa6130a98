"""Which blocks each request holds: prefix-cache lookup, slot allocation, freeing.

The manager works in tokens and blocks only; it never touches KV tensors. Invariant: request r
holds ceil(tokens_allocated(r) / block_size) blocks, listed in req_to_blocks[r] in logical order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hf_paged.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from hf_paged.core.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # block ids kept alongside the blocks so building block tables never walks objects
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks of the request already published
        self.prefix_cache_stats = PrefixCacheStats()
        # Copy-on-write of shared partial blocks (forked siblings and beams): (src, dst) block id
        # pairs the runner must copy before the next forward, and the requests whose block list
        # changed other than by appending (the runner rebuilds their block-table row).
        self.pending_copies: list[tuple[int, int]] = []
        self.changed_requests: set[str] = set()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ------------------------------------------------------------------------------

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to cover its full blocks among the first num_tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        extra = request_extra_keys(request)
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute (the sampler needs its logits), so a prompt
        that is entirely cached still recomputes its last block: a repeated 200-token prompt with
        block_size 16 computes 8 tokens, a repeated 192-token prompt 16.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs:
            # prompt log-probs need the logits of every prompt position: compute them all
            return [], 0
        self._update_block_hashes(request, request.num_tokens)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    # -- allocation --------------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens (after any prefix-cache hits), and for
        num_lookahead_tokens slots past them (a draft model's KV for the tokens it proposes).
        Returns the newly allocated blocks, or None (changing nothing) when the free blocks do
        not suffice."""
        rid = request.request_id
        held = self.req_to_blocks.get(rid)
        bs = self.block_size
        if held is not None and not new_computed_blocks:
            # Fast path, the common decode step: the new tokens fit in the blocks already held,
            # and the block they start in is not shared with a fork (no copy-on-write).
            start = request.num_computed_tokens
            end = start + num_new_tokens
            if end + num_lookahead_tokens <= len(held) * bs and (
                start % bs == 0 or held[start // bs].ref_cnt == 1
            ):
                if self.enable_caching and end // bs > self.num_cached_blocks[rid]:
                    self._cache_full_blocks(request, end)
                return []
        num_held = len(held) if held is not None else 0
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = self.blocks_needed(num_computed + num_new_tokens + num_lookahead_tokens)
        num_new_blocks = num_required - num_held - len(new_computed_blocks)
        # hits that sit in the free queue (ref_cnt 0) stop being free once we take them
        num_hits_from_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        # the block the new tokens start writing into is shared (a fork): copy it first
        cow = -1
        if held and num_computed % self.block_size:
            pos = num_computed // self.block_size
            if pos < num_held and held[pos].ref_cnt > 1:
                cow = pos
        if num_new_blocks + num_hits_from_free + (cow >= 0) > self.block_pool.get_num_free_blocks():
            return None
        if cow >= 0:
            self._copy_on_write(request, cow)
        if held is None:
            held = self.req_to_blocks[rid] = []
            self.req_to_block_ids[rid] = []
            self.num_cached_blocks[rid] = 0
        ids = self.req_to_block_ids[rid]
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            held.extend(new_computed_blocks)
            ids.extend(b.block_id for b in new_computed_blocks)
            self.num_cached_blocks[rid] = len(held)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        held.extend(new_blocks)
        ids.extend(b.block_id for b in new_blocks)
        if self.enable_caching:
            # Publish blocks that this step fills completely. Publishing before the forward is safe:
            # each layer writes the whole batch's K/V before any attention reads it, so a request
            # that hits one of these blocks later in the same step reads finished values.
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        # known tokens only: a block holding a token still pending on the GPU is hashed later
        num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        start = self.num_cached_blocks[rid]
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full * self.block_size)
        blocks = self.req_to_blocks[rid]
        for i in range(start, num_full):
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[rid] = num_full

    def _copy_on_write(self, request: Request, pos: int) -> None:
        rid = request.request_id
        held = self.req_to_blocks[rid]
        old = held[pos]
        new = self.block_pool.get_new_blocks(1)[0]
        held[pos] = new
        self.req_to_block_ids[rid][pos] = new.block_id
        self.block_pool.free_blocks([old])  # still held by the other sharers
        self.pending_copies.append((old.block_id, new.block_id))
        self.changed_requests.add(rid)

    def fork(self, parent: Request, child: Request) -> None:
        """Give child the parent's blocks by reference (n > 1 siblings, beams). Full blocks are
        shared for good; a shared partial last block is copied when either side writes to it."""
        # only the blocks of computed tokens: slots reserved past them (a draft model's
        # lookahead) are the parent's alone, and the child allocates its own
        blocks = self.req_to_blocks.get(parent.request_id, [])
        blocks = blocks[: self.blocks_needed(parent.num_computed_tokens)]
        self.free(child)
        self.block_pool.touch(blocks)
        cid = child.request_id
        self.req_to_blocks[cid] = list(blocks)
        self.req_to_block_ids[cid] = [b.block_id for b in blocks]
        num_cached = self.num_cached_blocks.get(parent.request_id, 0)
        self.num_cached_blocks[cid] = num_cached
        child.block_hashes = list(parent.block_hashes[:num_cached])
        self.changed_requests.add(cid)

    def reassign(self, requests: list[Request], sources: list[int]) -> None:
        """Beam search: request j takes the blocks of requests[sources[j]] (as they were before
        this call), by reference. Increments first, then decrements, so a block moving between
        beams never reaches zero references in between."""
        old = [list(self.req_to_blocks.get(r.request_id, [])) for r in requests]
        cached = [self.num_cached_blocks.get(r.request_id, 0) for r in requests]
        hashes = [list(r.block_hashes) for r in requests]
        for src in sources:
            self.block_pool.touch(old[src])
        for blocks in old:
            self.block_pool.free_blocks(reversed(blocks))
        for r, src in zip(requests, sources):
            rid = r.request_id
            self.req_to_blocks[rid] = list(old[src])
            self.req_to_block_ids[rid] = [b.block_id for b in old[src]]
            self.num_cached_blocks[rid] = cached[src]
            r.block_hashes = hashes[src][: cached[src]]
            self.changed_requests.add(rid)

    def take_block_changes(self) -> tuple[list[tuple[int, int]], set[str]]:
        copies, changed = self.pending_copies, self.changed_requests
        self.pending_copies, self.changed_requests = [], set()
        return copies, changed

    def free(self, request: Request) -> None:
        """Release the request's blocks, last first, so its tail is evicted before its prefix.
        Blocks published for tokens it never computed lose their hash first: allocate_slots
        publishes a step's blocks before the step runs, and a request preempted later in the
        same schedule() never runs it, so their KV was never written."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.req_to_block_ids.pop(rid, None)
        num_cached = self.num_cached_blocks.pop(rid, 0)
        if blocks:
            for block in blocks[request.num_computed_tokens // self.block_size : num_cached]:
                self.block_pool.uncache(block)
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_block_ids.get(request_id, [])

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError if block accounting is inconsistent (tests call it after runs)."""
        pool = self.block_pool
        refs = [0] * pool.num_blocks
        for rid, blocks in self.req_to_blocks.items():
            assert [b.block_id for b in blocks] == self.req_to_block_ids[rid], rid
            for b in blocks:
                refs[b.block_id] += 1
        free = set(pool.free_block_queue.block_ids())
        assert len(free) == pool.get_num_free_blocks(), "free queue count drifted"
        for block in pool.blocks:
            assert block.ref_cnt == refs[block.block_id], f"refcount mismatch on {block}"
            assert (block.ref_cnt == 0) == (block.block_id in free), f"free-queue mismatch {block}"
        used = sum(1 for r in refs if r > 0)
        assert used + len(free) == pool.num_blocks, "free + used != total"
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash, f"stale cache entry for {block}"


def request_extra_keys(request: Request) -> tuple | None:
    """Keys besides the tokens that decide whether KV can be shared: the LoRA adapter (two
    adapters never share KV, the same adapter does)."""
    name = request.sampling_params.adapter
    return None if name is None else ("lora", name)
