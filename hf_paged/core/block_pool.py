"""Physical KV blocks: reference counts, the LRU free queue, and the prefix-cache hash table.

A block with ref_cnt 0 sits in the free queue but keeps its hash and contents until it is handed
out again, so a later request with the same prefix can take it back (a prefix-cache hit). The
free queue is a doubly linked list threaded through the blocks: taking a cached block back out of
the middle is O(1), and the queue order is the eviction order (head = least recently freed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple


class BlockHash(NamedTuple):
    """Identity of a full block's contents: the chain hash plus the exact tokens and extra keys, so
    a 64-bit collision can only alias blocks whose own tokens are equal too."""

    hash_value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple | None = None


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    tokens = tuple(token_ids)
    parent_value = None if parent is None else parent.hash_value
    return BlockHash(hash((parent_value, tokens, extra_keys)), tokens, extra_keys)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels; O(1) popleft, append and remove.

    Blocks never handed out yet (num_unused of them, ids from first_unused) are not linked in:
    they head the queue in id order (every freed block joins the tail after them) and each is
    made when popleft first hands it out, then passed to `made`. Building every block up front
    cost ~0.7 s of start-up at 300k blocks (the 1.1B shape's cache on an H200 has ~330k)."""

    def __init__(
        self,
        blocks: Iterable[KVCacheBlock] = (),
        num_unused: int = 0,
        first_unused: int = 0,
        made: Callable[[KVCacheBlock], None] | None = None,
    ) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._next_unused, self._end_unused = first_unused, first_unused + num_unused
        self._made = made
        self.num_free_blocks = num_unused
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        if self._next_unused < self._end_unused:
            block = KVCacheBlock(self._next_unused)
            self._next_unused += 1
            self.num_free_blocks -= 1
            if self._made is not None:
                self._made(block)
            return block
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> Iterator[int]:
        """The free blocks' ids in queue order (the unused ones first)."""
        yield from range(self._next_unused, self._end_unused)
        block = self._head.next_free
        while block is not self._tail:
            yield block.block_id
            block = block.next_free


class BlockPool:
    """Owns every KVCacheBlock. Blocks move: free queue -> request (ref_cnt >= 1) -> free queue;
    a block exists as an object from the first time it is handed out (FreeBlockQueue)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # every block handed out so far, by id (ids are handed out in order the first time)
        self.blocks: list[KVCacheBlock] = []
        self.free_block_queue = FreeBlockQueue(num_unused=num_blocks, made=self.blocks.append)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue (least recently freed), evicting hashes."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise RuntimeError(
                f"asked for {num_blocks} blocks, {self.free_block_queue.num_free_blocks} free"
            )
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self.uncache(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget the block's hash (it is being reused, or its contents were never computed)."""
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to prefix-cache hits; a hit that was free leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the tail of the free queue, in the
        given order (callers pass a request's blocks last-first, so its tail is evicted first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Publish a full block under its hash. If the same contents are already published (two
        requests computed the same prefix at once), the first copy stays the cached one."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Only allowed when no request holds a block (as in vLLM)."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True
