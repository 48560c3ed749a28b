"""KV cache accounting as metrics: the PagedAttention paper's Fig. 2 breakdown of the slots in use (token states,
internal fragmentation, reservation), what block sharing saves, and the prefix-cache hit rate (the gauges that
export them are in prometheus.py: the engine core imports this module for its log line, without prometheus).

The engine core adds the accounting (`SchedulerStats.memory`, from KVCacheManager.memory_stats) to its stats at
most every KV_STATS_INTERVAL_S while busy, and whenever it drains.
"""

from __future__ import annotations

KV_STATS_INTERVAL_S = 0.25

# SchedulerStats.memory key -> (metric name after "pagemill:", help)
KV_GAUGES = {
    "token_slots": ("kv_cache_token_slots", "KV slots holding a token's state (the paper's token states)."),
    "slots_fragmented": ("kv_cache_fragmented_slots",
                         "Empty KV slots of partly-filled blocks (internal fragmentation)."),
    "slots_reserved": ("kv_cache_reserved_slots",
                       "KV slots of blocks allocated ahead that hold no token yet (reservation)."),
    "slots_total": ("kv_cache_total_slots", "KV slots of all usable blocks."),
    "blocks_partial": ("kv_cache_partial_blocks", "Partly-filled KV blocks."),
    "blocks_shared": ("kv_cache_shared_blocks", "KV blocks referenced by more than one request."),
    "blocks_saved_by_sharing": ("kv_cache_sharing_saved_blocks",
                                "KV blocks that sharing saves: block-table references minus blocks in use."),
    "bytes_saved_by_sharing": ("kv_cache_sharing_saved_bytes", "KV cache bytes that block sharing saves."),
}
HIT_RATE_GAUGE = "kv_cache_prefix_hit_rate"


def hit_rate(hits: float, queries: float) -> float:
    """Hits over queries (0 without queries)."""
    return hits / queries if queries > 0 else 0.0


def kv_log_line(memory: dict[str, float]) -> str:
    """One log line of the accounting: how the slots in use divide, and what sharing saves."""
    used = memory["token_slots"] + memory["slots_fragmented"] + memory["slots_reserved"]

    def pct(n: float) -> float:
        return 100 * n / used if used else 0.0

    return (f"KV cache slots in use: {used:.0f} of {memory.get('slots_total', 0):.0f}: token states "
            f"{memory['token_slots']:.0f} ({pct(memory['token_slots']):.1f}%), internal fragmentation "
            f"{memory['slots_fragmented']:.0f} ({pct(memory['slots_fragmented']):.1f}%) in "
            f"{memory['blocks_partial']:.0f} partly-filled blocks, reserved {memory['slots_reserved']:.0f} "
            f"({pct(memory['slots_reserved']):.1f}%); blocks shared: {memory['blocks_shared']:.0f}, saved by "
            f"sharing: {memory['blocks_saved_by_sharing']:.0f} blocks "
            f"({memory.get('bytes_saved_by_sharing', 0) / 2**20:.1f} MiB)")
