"""Per-request block tables on top of the block pool: prefix-cache lookups, slot allocation, freeing."""

from __future__ import annotations

from pagemill.core.block_pool import BlockPool, KVCacheBlock
from pagemill.core.kv_cache_utils import extend_block_hashes, get_hash_fn
from pagemill.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Allocates and frees KV blocks for requests; finds cached prefixes (vLLM v1's interface)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = "builtin") -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.hash_fn = get_hash_fn(hash_algo)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.blocks_to_copy: list[tuple[int, int]] = []  # copy-on-write (src, dst), drained every step
        self.replaced_blocks: dict[str, list[tuple[int, int]]] = {}  # req -> (table index, new block id)
        self._num_stored: dict[str, int] = {}  # tokens each request keeps in its blocks
        self.num_cow_copies = 0

    @property
    def usage(self) -> float:
        """Fraction of the KV cache in use."""
        return self.block_pool.get_usage()

    def _ensure_hashes(self, request: Request, num_full_blocks: int) -> None:
        extra = (request.cache_salt,) if request.cache_salt else None
        extend_block_hashes(self.hash_fn, request.block_hashes, request.all_token_ids, self.block_size,
                            num_full_blocks, extra)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request, and how many tokens that is.

        The last token is never a hit: its logits must be computed.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._ensure_hashes(request, max_blocks)
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens; None (and no change) if the pool is too small."""
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = num_required - len(req_blocks) - len(new_computed_blocks)
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        # Shared blocks that this step writes into must be copied first (copy-on-write).
        cow = [i for i in range(num_computed // self.block_size, min(len(req_blocks), num_required))
               if req_blocks[i].ref_cnt > 1]
        if num_new_blocks + len(cow) > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        for i in cow:
            src = req_blocks[i]
            dst = self.block_pool.get_new_blocks(1)[0]
            self.block_pool.free_blocks([src])
            req_blocks[i] = dst
            self.blocks_to_copy.append((src.block_id, dst.block_id))
            self.num_cow_copies += 1
            self.replaced_blocks.setdefault(request.request_id, []).append((i, dst.block_id))
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        self._num_stored[request.request_id] = num_computed + num_new_tokens
        if self.enable_caching:
            num_full = (num_computed + num_new_tokens) // self.block_size
            start = self.num_cached_blocks.get(request.request_id, 0)
            if num_full > start:
                self._ensure_hashes(request, num_full)
                self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, start, num_full)
                self.num_cached_blocks[request.request_id] = num_full
        return new_blocks

    def allocate_for_swap_in(self, request: Request, num_blocks: int) -> list[KVCacheBlock]:
        """Fresh blocks for a swapped-out request's contents (the caller checked there is room)."""
        blocks = self.block_pool.get_new_blocks(num_blocks)
        self.req_to_blocks[request.request_id] = list(blocks)
        self.num_cached_blocks[request.request_id] = 0
        self._num_stored[request.request_id] = request.num_computed_tokens
        return blocks

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Share the parent's blocks holding its first `num_tokens` tokens with `child` (by reference count)."""
        blocks = self.req_to_blocks[parent.request_id][: cdiv(num_tokens, self.block_size)]
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        full = num_tokens // self.block_size
        if self.enable_caching:
            self.num_cached_blocks[child.request_id] = min(self.num_cached_blocks.get(parent.request_id, 0), full)
        child.block_hashes = parent.block_hashes[:full]
        self._num_stored[child.request_id] = num_tokens

    def take_step_changes(self) -> tuple[list[tuple[int, int]], dict[str, list[tuple[int, int]]]]:
        """The copy-on-write copies and block-table replacements made since the last call."""
        out = (self.blocks_to_copy, self.replaced_blocks)
        self.blocks_to_copy, self.replaced_blocks = [], {}
        return out

    def memory_stats(self) -> dict[str, float]:
        """Blocks used and shared, tokens stored, reserved-but-unused slots, and the saving from sharing."""
        logical = sum(len(b) for b in self.req_to_blocks.values())
        used = {b.block_id for blocks in self.req_to_blocks.values() for b in blocks}
        shared = sum(1 for bid in used if self.block_pool.blocks[bid].ref_cnt > 1)
        stored = sum(self._num_stored.get(rid, 0) for rid in self.req_to_blocks)
        return {"blocks_used": len(used), "blocks_shared": shared, "logical_blocks": logical,
                "tokens_stored": stored, "slots_reserved_unused": logical * self.block_size - stored,
                "sharing_saving": (1 - len(used) / logical) if logical else 0.0}

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so that its last blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self._num_stored.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes (only when nothing runs)."""
        return self.block_pool.reset_prefix_cache()
