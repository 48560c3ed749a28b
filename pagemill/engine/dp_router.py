"""Which data-parallel engine gets a request: least-loaded (vLLM's score) or prefix-cache affinity (SGLang's
cache-aware router), with the load as the tie-breaker and the brake."""

from __future__ import annotations

from collections import OrderedDict

from pagemill.config import DataParallelConfig
from pagemill.core.kv_cache_utils import extend_block_hashes, get_hash_fn
from pagemill.messages import EngineCoreRequest
from pagemill.metrics.stats import SchedulerStats


class PrefixIndex:
    """Block hashes of the prompts recently sent to one engine, least recently used first (bounded: an engine
    cannot hold more blocks than its KV cache has, so older entries are likely evicted there too)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.hashes: OrderedDict[int, None] = OrderedDict()

    def match(self, block_hashes: list[int]) -> int:
        """How many leading blocks of the chain this engine was sent (a chained hash implies its whole prefix)."""
        n = 0
        for h in block_hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def insert(self, block_hashes: list[int]) -> None:
        """Record a chain as most recently used, dropping the least recently used beyond the capacity."""
        for h in block_hashes:
            self.hashes[h] = None
            self.hashes.move_to_end(h)
        while len(self.hashes) > self.capacity:
            self.hashes.popitem(last=False)

    def clear(self) -> None:
        """Forget everything (the engine's prefix cache was reset)."""
        self.hashes.clear()


class DPRouter:
    """Routes requests over `num_engines` engines and keeps the load each one has as the router sees it."""

    def __init__(self, config: DataParallelConfig, block_size: int, hash_algo: str, prefix_caching: bool,
                 capacities: list[int]) -> None:
        n = config.data_parallel_size
        self.affinity = config.routing == "prefix-affinity" and prefix_caching
        self.threshold = config.imbalance_threshold
        self.block_size = block_size
        self.hash_fn = get_hash_fn(hash_algo)
        self.waiting = [0] * n  # from each engine's latest stats ...
        self.running = [0] * n
        self.pending = [0] * n  # ... plus what the router sent it since those stats
        self.indexes = [PrefixIndex(c) for c in capacities]
        self.num_affinity_routed = 0  # requests sent to a cached prefix rather than to the least-loaded engine

    def score(self, i: int) -> int:
        """vLLM's load score of engine i: waiting x 4 + running."""
        return 4 * (self.waiting[i] + self.pending[i]) + self.running[i]

    def least_loaded(self) -> int:
        """The engine with the lowest score (the lowest index on a tie)."""
        return min(range(len(self.waiting)), key=self.score)

    def block_hashes(self, req: EngineCoreRequest) -> list[int]:
        """The chained hashes of the prompt's full blocks, keyed like the KV cache manager's (adapter, salt)."""
        lora_id = req.lora_request.lora_int_id if req.lora_request is not None else 0
        extra = (lora_id, req.cache_salt) if lora_id or req.cache_salt else None
        hashes: list[int] = []
        tokens = req.prompt_token_ids
        spans = [(f.offset, f.length, f.identifier) for f in req.mm_features] if req.mm_features else None
        extend_block_hashes(self.hash_fn, hashes, tokens, self.block_size, len(tokens) // self.block_size, extra,
                            spans)
        return hashes

    def route(self, req: EngineCoreRequest) -> int:
        """Pick the engine for a new request and count it there."""
        least = self.least_loaded()
        chosen = least
        if self.affinity:
            hashes = self.block_hashes(req)
            if hashes:
                matched = [index.match(hashes) for index in self.indexes]
                best = max(range(len(matched)), key=lambda i: (matched[i], -self.score(i)))
                if matched[best] > 0 and best != least and self.score(best) - self.score(least) <= self.threshold:
                    chosen = best
                    self.num_affinity_routed += 1
                elif matched[best] > 0 and best == least:
                    self.num_affinity_routed += 1
            self.indexes[chosen].insert(hashes)
        self.pending[chosen] += 1
        return chosen

    def assign(self, engine: int) -> None:
        """Count a request sent to a given engine (a sibling that must share its parent's engine)."""
        self.pending[engine] += 1

    def update_stats(self, engine: int, stats: SchedulerStats) -> None:
        """An engine's fresh queue sizes replace what the router had counted for it."""
        self.waiting[engine] = stats.num_waiting_reqs
        self.running[engine] = stats.num_running_reqs
        self.pending[engine] = 0

    def clear_prefixes(self) -> None:
        """Forget every engine's prefixes (their caches were reset)."""
        for index in self.indexes:
            index.clear()
