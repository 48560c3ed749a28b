"""Physical KV blocks: reference counts, an LRU free queue, and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    """One block of KV memory: an id, a reference count and, once full and cached, its hash."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: tuple[int, int] | None = None  # (block hash, KV cache group) once full and cached
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append, and removal from the middle.

    Its order is the eviction order: blocks freed earliest (and tails of a request before heads) go first.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the first (least recently freed) block."""
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("No free blocks.")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` (it is being reused by a prefix-cache hit)."""
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the end of the queue."""
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """All KV blocks of the cache, shared by every KV cache group (a block id belongs to one group at a time).

    Block 0 is a reserved null block: it pads block tables and stands for a sliding group's dropped blocks;
    touching and freeing skip it.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:  # (1: the null block alone, for a model without KV-cache layers)
            raise ValueError(f"The KV cache needs at least the null block, got {num_blocks} blocks.")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.num_usable_blocks = self.free_block_queue.num_free_blocks  # all but the null block
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        self.cached_block_hash_to_block: dict[tuple[int, int], KVCacheBlock] = {}
        # Kept as blocks are taken and freed, so that the memory accounting needs no scan of the blocks:
        self.num_block_refs = 0  # references from block tables (the sum of ref_cnt over usable blocks)
        self.num_shared_blocks = 0  # blocks with more than one reference

    def get_cached_block(self, block_hash: int, group_id: int = 0) -> KVCacheBlock | None:
        """The block holding group `group_id`'s KV of `block_hash`, if still cached."""
        return self.cached_block_hash_to_block.get((block_hash, group_id))

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[int], start: int, end: int,
                          group_id: int = 0) -> None:
        """Register blocks[start:end] (now full) of group `group_id` under their hashes."""
        null = self.null_block
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None or block is null:
                continue  # a prefix hit (already cached), or a dropped sliding-window block
            key = (block_hashes[i], group_id)
            block.block_hash = key
            self.cached_block_hash_to_block.setdefault(key, block)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the head of the free queue, evicting their cached hashes."""
        if n > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks from the pool.")
        out = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        self.num_block_refs += n
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is not None:
            if self.cached_block_hash_to_block.get(h) is block:
                del self.cached_block_hash_to_block[h]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to blocks found by a prefix-cache hit (pulling free ones out of the queue)."""
        null = self.null_block
        for block in blocks:
            if block is null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            self.num_block_refs += 1
            if block.ref_cnt == 2:
                self.num_shared_blocks += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue in this order."""
        null = self.null_block
        for block in ordered_blocks:
            if block is null:
                continue
            block.ref_cnt -= 1
            self.num_block_refs -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
            elif block.ref_cnt == 1:
                self.num_shared_blocks -= 1

    def get_num_free_blocks(self) -> int:
        """Blocks that can be allocated (including evictable cached ones)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks in use."""
        if not self.num_usable_blocks:  # no KV cache (encoder-only model)
            return 0.0
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for b in self.blocks:
            b.block_hash = None
        return True
