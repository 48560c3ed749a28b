"""The block tables of one KV cache group (vLLM v1's single-type managers): full attention or a sliding window.

Every group's table of a request has the same length (one entry per block of the sequence); a sliding group
replaces the entries its window has left behind with the null block and returns those blocks to the pool.
"""

from __future__ import annotations

from pagemill.core.block_pool import BlockPool, KVCacheBlock


class FullAttentionManager:
    """Block tables of a full-attention group: a request keeps every block of its sequence."""

    def __init__(self, pool: BlockPool, block_size: int, group_id: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    def find_longest_cache_hit(self, block_hashes: list[int], max_blocks: int) -> list[KVCacheBlock]:
        """The longest run of cached blocks from the start, at most `max_blocks` long."""
        hits: list[KVCacheBlock] = []
        get = self.pool.get_cached_block
        for h in block_hashes[:max_blocks]:
            block = get(h, self.group_id)
            if block is None:
                break
            hits.append(block)
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Full attention needs every block: nothing to drop."""

    def plan(self, request_id: str, num_required: int, hits: list[KVCacheBlock],
             num_computed: int) -> tuple[int, list[int]]:
        """(blocks the pool must give, table indices to copy on write) for a table of `num_required` blocks whose
        tokens from `num_computed` on are written this step."""
        blocks = self.req_to_blocks.get(request_id, ())
        # Shared blocks that this step writes into must be copied first (copy-on-write).
        cow = [i for i in range(num_computed // self.block_size, min(len(blocks), num_required))
               if blocks[i].ref_cnt > 1]
        evictable = sum(1 for b in hits if b.ref_cnt == 0 and b is not self.pool.null_block)
        return max(num_required - len(blocks) - len(hits), 0) + len(cow) + evictable, cow

    def allocate(self, request_id: str, num_required: int, hits: list[KVCacheBlock], cow: list[int],
                 copies: list[tuple[int, int]], replaced: list[tuple[int, int, int]]) -> list[KVCacheBlock]:
        """Apply a plan: copy-on-write (appending to `copies` and `replaced`), append the hits (the caller touched
        them before any group took new blocks, which could evict them) and new blocks."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        pool = self.pool
        for i in cow:
            src = blocks[i]
            dst = pool.get_new_blocks(1)[0]
            pool.free_blocks([src])
            blocks[i] = dst
            copies.append((src.block_id, dst.block_id))
            replaced.append((self.group_id, i, dst.block_id))
        blocks.extend(hits)
        new_blocks = pool.get_new_blocks(max(num_required - len(blocks), 0))
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request_id: str, block_hashes: list[int], num_full: int) -> None:
        """Register the request's full blocks up to `num_full` in the prefix cache."""
        start = self.num_cached_blocks.get(request_id, 0)
        if num_full > start:
            self.pool.cache_full_blocks(self.req_to_blocks[request_id], block_hashes, start, num_full, self.group_id)
            self.num_cached_blocks[request_id] = num_full

    def set_table(self, request_id: str, blocks: list[KVCacheBlock], num_cached: int) -> None:
        """Give a request a table (a fork's shared blocks, or a swap-in's fresh ones) already referenced."""
        self.req_to_blocks[request_id] = blocks
        self.num_cached_blocks[request_id] = num_cached

    def free_tail(self, request_id: str, num_blocks: int) -> bool:
        """Release the request's blocks past its first `num_blocks` (slots of rejected draft tokens); True if any."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or len(blocks) <= num_blocks:
            return False
        tail = blocks[num_blocks:]
        del blocks[num_blocks:]
        self.pool.free_blocks(reversed(tail))
        return True

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first so that its last blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))


class SlidingWindowManager(FullAttentionManager):
    """Block tables of a sliding-window group: blocks wholly before the next step's window go back to the pool."""

    def __init__(self, pool: BlockPool, block_size: int, group_id: int, sliding_window: int) -> None:
        super().__init__(pool, block_size, group_id)
        self.sliding_window = sliding_window
        # A hit ending at a block boundary L needs the keys of positions [L - W + 1, L): this many blocks.
        self.window_blocks = -(-(sliding_window - 1) // block_size)

    def find_longest_cache_hit(self, block_hashes: list[int], max_blocks: int) -> list[KVCacheBlock]:
        """The longest hit (at most `max_blocks`) whose last `window_blocks` blocks are cached (or that is cached
        from the start); null blocks stand before them (vLLM's SlidingWindowManager)."""
        null = self.pool.null_block
        hits = [null] * max_blocks
        get, gid, need = self.pool.get_cached_block, self.group_id, self.window_blocks
        if need == 0:
            return hits
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = get(block_hashes[i], gid)
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= need:
                return hits[:i + run]
        return hits[:run]  # the run that reaches the first block (shorter than the window) is a hit too

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Return the blocks wholly before the first key the next query (at `num_computed_tokens`) attends to."""
        first_useful = (num_computed_tokens - self.sliding_window + 1) // self.block_size
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or first_useful <= 0:
            return
        null = self.pool.null_block
        i = min(first_useful, len(blocks)) - 1
        removed: list[KVCacheBlock] = []
        while i >= 0 and blocks[i] is not null:  # nulls are a prefix: stop at the first one
            removed.append(blocks[i])
            blocks[i] = null
            i -= 1
        self.pool.free_blocks(reversed(removed))  # oldest first: evicted first


def make_manager(pool: BlockPool, block_size: int, group_id: int, sliding_window: int | None) -> FullAttentionManager:
    """The manager for a group of this attention type."""
    if sliding_window is None:
        return FullAttentionManager(pool, block_size, group_id)
    return SlidingWindowManager(pool, block_size, group_id, sliding_window)
