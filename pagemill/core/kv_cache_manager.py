"""Per-request block tables on top of the block pool: prefix-cache lookups, slot allocation, freeing.

One block table per KV cache group (vLLM v1's hybrid KV cache manager): layers are grouped by attention type, and
a sliding-window group drops the blocks its window has left behind. All groups share one pool; a request's
tables have equal lengths, so they grow together.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagemill.core.block_pool import BlockPool, KVCacheBlock
from pagemill.core.kv_cache_utils import extend_block_hashes, get_hash_fn
from pagemill.core.single_type_manager import FullAttentionManager, make_manager
from pagemill.request import Request

KVCacheBlocks = tuple[Sequence[KVCacheBlock], ...]  # one sequence per KV cache group
SwapLayout = tuple[int, tuple[int, ...]]  # (table length, leading null entries per group) of a swapped request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Allocates and frees KV blocks for requests; finds cached prefixes (vLLM v1's interface)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = "builtin", group_windows: Sequence[int | None] = (None,)) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.hash_fn = get_hash_fn(hash_algo)
        self.groups: list[FullAttentionManager] = [make_manager(self.block_pool, block_size, g, w)
                                                   for g, w in enumerate(group_windows)]
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.blocks_to_copy: list[tuple[int, int]] = []  # copy-on-write (src, dst), drained every step
        # req -> (group, table index, new block id) after copy-on-write
        self.replaced_blocks: dict[str, list[tuple[int, int, int]]] = {}
        self._num_stored: dict[str, int] = {}  # tokens each request keeps in its blocks
        self.num_cow_copies = 0
        self._no_hits: KVCacheBlocks = self.empty_blocks()  # read only
        # every group full attention: nothing ever leaves a window, so a decode step inside a block needs no plan
        self._all_full = all(type(g) is FullAttentionManager for g in self.groups)
        self._no_new_blocks: KVCacheBlocks = tuple(() for _ in self.groups)  # read only (the fast path's answer)

    @property
    def usage(self) -> float:
        """Fraction of the KV cache in use."""
        return self.block_pool.get_usage()

    def empty_blocks(self) -> KVCacheBlocks:
        """No blocks in any group."""
        return tuple([] for _ in self.groups)

    def _ensure_hashes(self, request: Request, num_full_blocks: int) -> None:
        # Blocks computed under another adapter (or salt) hold other KV: the adapter id and the salt key the hash.
        extra = (request.lora_int_id, request.cache_salt) if request.lora_int_id or request.cache_salt else None
        spans = ([(f.offset, f.length, f.identifier) for f in request.mm_features] if request.mm_features
                 else None)
        extend_block_hashes(self.hash_fn, request.block_hashes, request.all_token_ids, self.block_size,
                            num_full_blocks, extra, spans)

    def get_computed_blocks(self, request: Request, count: bool = True) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix every group can serve (its blocks per group), and how many tokens that is.

        The last token is never a hit: its logits must be computed. A sliding group serves a prefix of length L
        when it holds the blocks of the window before L; a shorter L is tried until all groups agree.
        `count=False`: a look that the hit-rate counters do not see (a scheduling policy ranking requests).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.empty_blocks(), 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._ensure_hashes(request, max_blocks)
        hashes = request.block_hashes
        while True:
            hits = tuple(g.find_longest_cache_hit(hashes, max_blocks) for g in self.groups)
            n = min(len(h) for h in hits)
            if all(len(h) == n for h in hits):
                break
            max_blocks = n  # a full group's hit shortens exactly; a sliding group's must be found again
        if count:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += n * self.block_size
        return hits, n * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens; the new blocks per group, or None (and no change but the
        dropping of blocks outside a sliding window) if the pool is too small."""
        rid = request.request_id
        if self._all_full and new_computed_blocks is None and not num_new_computed_tokens:
            fast = self._within_block(request, num_new_tokens, num_lookahead_tokens)
            if fast is not None:
                return fast
        hits = new_computed_blocks or self._no_hits
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        need = 0
        plans = []
        for g, group_hits in zip(self.groups, hits):
            g.remove_skipped_blocks(rid, num_computed)
            n, cow = g.plan(rid, num_required, group_hits, num_computed)
            need += n
            plans.append(cow)
        if need > self.block_pool.get_num_free_blocks():
            return None
        for group_hits in hits:
            self.block_pool.touch(group_hits)
        replaced: list[tuple[int, int, int]] = []
        new_blocks = tuple(g.allocate(rid, num_required, group_hits, cow, self.blocks_to_copy, replaced)
                           for g, group_hits, cow in zip(self.groups, hits, plans))
        if replaced:
            self.num_cow_copies += len(replaced)
            self.replaced_blocks.setdefault(rid, []).extend(replaced)
        self._num_stored[rid] = num_computed + num_new_tokens
        if self.enable_caching:
            # Only committed tokens are hashed: draft tokens beyond request.num_tokens may be rejected.
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            if num_full > len(request.block_hashes):
                self._ensure_hashes(request, num_full)
            for g in self.groups:
                g.cache_blocks(rid, request.block_hashes, num_full)
        return new_blocks

    def _within_block(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int) -> KVCacheBlocks | None:
        """The decode fast path of allocate_slots (no plan, no hashing): the step's tokens (and lookahead) fall in the
        block that holds the request's next position, which every group already holds unshared, and no block fills
        up. None when that is not so (the full path decides)."""
        bs = self.block_size
        num_computed = request.num_computed_tokens
        b = num_computed // bs
        end = num_computed + num_new_tokens
        if end // bs != b or (end + num_lookahead_tokens - 1) // bs != b:
            return None
        rid = request.request_id
        for g in self.groups:
            blocks = g.req_to_blocks.get(rid)
            if blocks is None or len(blocks) <= b or blocks[b].ref_cnt != 1:
                return None
        self._num_stored[rid] = end
        return self._no_new_blocks

    def free_tail(self, request: Request, num_tokens: int) -> int | None:
        """After draft tokens were rejected: release the blocks that hold none of the first `num_tokens` tokens.
        Returns the tables' new length if they were cut, else None."""
        keep = cdiv(num_tokens, self.block_size)
        self._num_stored[request.request_id] = num_tokens
        cut = False
        for g in self.groups:
            cut |= g.free_tail(request.request_id, keep)
        return keep if cut else None

    def swap_layout(self, request_id: str) -> tuple[list[int], SwapLayout]:
        """The request's blocks to swap out (group by group, null entries left out) and the layout to restore."""
        ids, leads = [], []
        null = self.block_pool.null_block
        length = 0
        for g in self.groups:
            blocks = g.req_to_blocks.get(request_id, [])
            length = len(blocks)
            lead = next((i for i, b in enumerate(blocks) if b is not null), length)
            leads.append(lead)
            ids.extend(b.block_id for b in blocks[lead:])
        return ids, (length, tuple(leads))

    def allocate_for_swap_in(self, request: Request, layout: SwapLayout) -> list[KVCacheBlock]:
        """Fresh blocks for a swapped-out request's contents, in swap_layout's order (the caller checked room)."""
        length, leads = layout
        null = self.block_pool.null_block
        out: list[KVCacheBlock] = []
        for g, lead in zip(self.groups, leads):
            blocks = self.block_pool.get_new_blocks(length - lead)
            g.set_table(request.request_id, [null] * lead + blocks, 0)
            out.extend(blocks)
        self._num_stored[request.request_id] = request.num_computed_tokens
        return out

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Share the parent's blocks holding its first `num_tokens` tokens with `child` (by reference count)."""
        n, full = cdiv(num_tokens, self.block_size), num_tokens // self.block_size
        for g in self.groups:
            blocks = g.req_to_blocks[parent.request_id][:n]
            self.block_pool.touch(blocks)
            g.set_table(child.request_id, list(blocks), min(g.num_cached_blocks.get(parent.request_id, 0), full))
        child.block_hashes = parent.block_hashes[:full]
        self._num_stored[child.request_id] = num_tokens

    def take_step_changes(self) -> tuple[list[tuple[int, int]], dict[str, list[tuple[int, int, int]]]]:
        """The copy-on-write copies and block-table replacements made since the last call."""
        out = (self.blocks_to_copy, self.replaced_blocks)
        self.blocks_to_copy, self.replaced_blocks = [], {}
        return out

    def memory_stats(self) -> dict[str, float]:
        """The KV slots in use broken down as in the PagedAttention paper's Fig. 2, and what sharing saves.

        Slots of blocks in use are token states, internal fragmentation (the empty slots of partly-filled blocks)
        or reservation (blocks allocated ahead that hold no token yet, e.g. draft-model lookahead); a block shared
        by k tables counts 1/k in each. O(requests x groups): the pool keeps the reference counts' totals.
        """
        pool, bs, null = self.block_pool, self.block_size, self.block_pool.null_block
        used = pool.num_usable_blocks - pool.get_num_free_blocks()
        refs = pool.num_block_refs
        partial = fragmented = reserved = 0.0
        for g in self.groups:
            for rid, blocks in g.req_to_blocks.items():
                i, filled = divmod(self._num_stored.get(rid, 0), bs)
                if filled and i < len(blocks):
                    b = blocks[i]
                    partial += 1 / b.ref_cnt
                    fragmented += (bs - filled) / b.ref_cnt
                    i += 1
                for j in range(i, len(blocks)):
                    if blocks[j] is not null:
                        reserved += bs / blocks[j].ref_cnt
        fragmented, reserved = round(fragmented), round(reserved)
        return {"blocks_used": used, "blocks_shared": pool.num_shared_blocks, "logical_blocks": refs,
                "tokens_stored": sum(self._num_stored.get(rid, 0) for rid in (self.groups[0].req_to_blocks if self.groups else {})),
                "token_slots": used * bs - fragmented - reserved, "slots_fragmented": fragmented,
                "slots_reserved": reserved, "slots_reserved_unused": fragmented + reserved,
                "blocks_partial": round(partial), "blocks_saved_by_sharing": refs - used,
                "slots_total": pool.num_usable_blocks * bs,
                "sharing_saving": (1 - used / refs) if refs else 0.0}

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks (not null) in the request's tables, all groups together."""
        null = self.block_pool.null_block
        return sum(1 for g in self.groups for b in g.req_to_blocks.get(request_id, ()) if b is not null)

    def free(self, request: Request) -> None:
        """Release a request's blocks in every group."""
        for g in self.groups:
            g.free(request.request_id)
        self._num_stored.pop(request.request_id, None)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table of each group."""
        return [[b.block_id for b in g.req_to_blocks.get(request_id, [])] for g in self.groups]

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes (only when nothing runs)."""
        return self.block_pool.reset_prefix_cache()
