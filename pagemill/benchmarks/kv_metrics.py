"""`bench serve --kv-metrics-plot`: sample a pagemill server's KV accounting (its /metrics page) during each run.

A sample holds the pagemill:kv_cache_* gauges (the PagedAttention paper's Fig. 2 breakdown of the slots in use,
block sharing), the prefix-cache counters and the queue sizes, with `t`, seconds since the run started. The
engine core refreshes the accounting every KV_STATS_INTERVAL_S (0.25 s) while busy: faster sampling only repeats
values.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pagemill.metrics.kv_cache import HIT_RATE_GAUGE, KV_GAUGES

_GAUGES = {f"pagemill:{name}": name for name, _ in KV_GAUGES.values()} | {
    f"pagemill:{HIT_RATE_GAUGE}": HIT_RATE_GAUGE,
    "pagemill:kv_cache_usage_perc": "kv_cache_usage_perc",
    "pagemill:num_requests_running": "num_requests_running",
    "pagemill:num_requests_waiting": "num_requests_waiting",
}
_COUNTERS = {"pagemill:prefix_cache_hits": "prefix_cache_hits", "pagemill:prefix_cache_queries": "prefix_cache_queries"}


def parse_kv_sample(text: str) -> dict[str, float] | None:
    """The KV accounting of a Prometheus text page (summed over models); None when it has none (not pagemill)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    usage: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = _GAUGES.get(sample.name)
            if key is None and sample.name.endswith("_total"):
                key = _COUNTERS.get(sample.name[:-len("_total")])
            if key == "kv_cache_usage_perc":
                usage.append(sample.value)
            elif key is not None:
                out[key] = out.get(key, 0.0) + sample.value
    if "kv_cache_token_slots" not in out:
        return None
    # Ratios do not add up over data-parallel engines (`engine` label): the usage is their mean, the hit rate the
    # summed counters' ratio.
    if usage:
        out["kv_cache_usage_perc"] = sum(usage) / len(usage)
    if len(usage) > 1 and "prefix_cache_queries" in out:
        out[HIT_RATE_GAUGE] = out.get("prefix_cache_hits", 0.0) / out["prefix_cache_queries"] \
            if out["prefix_cache_queries"] else 0.0
    return out


class KVSampler:
    """Polls `base_url`/metrics every `interval_s` in the background, from entering the block to leaving it."""

    def __init__(self, base_url: str, interval_s: float = 0.5) -> None:
        if interval_s <= 0:
            raise ValueError(f"--kv-metrics-interval must be positive, got {interval_s}")
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.samples: list[dict[str, float]] = []
        self._task: asyncio.Task | None = None
        self._start = 0.0

    async def _sample(self, session: Any) -> None:
        import aiohttp

        try:
            async with session.get(self.url) as resp:
                if resp.status != 200:
                    return
                values = parse_kv_sample(await resp.text())
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return
        if values is not None:
            self.samples.append({"t": time.perf_counter() - self._start, **values})

    async def _run(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            while True:
                await self._sample(session)
                await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> "KVSampler":
        self._start = time.perf_counter()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


def kv_summary(samples: list[dict[str, float]]) -> dict[str, float]:
    """Averages over the samples taken while slots were in use, and the run's prefix-cache hit rate."""
    busy = [s for s in samples if s["kv_cache_token_slots"] + s["kv_cache_fragmented_slots"] > 0]
    out: dict[str, float] = {"num_samples": len(samples), "num_busy_samples": len(busy)}
    if busy:
        def mean(values: list[float]) -> float:
            return sum(values) / len(values)

        used = [s["kv_cache_token_slots"] + s["kv_cache_fragmented_slots"] + s["kv_cache_reserved_slots"]
                for s in busy]
        out["mean_used_slots_pct"] = 100 * mean([u / max(s["kv_cache_total_slots"], 1) for u, s in zip(used, busy)])
        for key, name in (("kv_cache_token_slots", "token_states"), ("kv_cache_fragmented_slots", "fragmentation"),
                          ("kv_cache_reserved_slots", "reservation")):
            out[f"mean_{name}_pct_of_used"] = 100 * mean([s[key] / u for u, s in zip(used, busy)])
        out["mean_shared_blocks"] = mean([s["kv_cache_shared_blocks"] for s in busy])
        out["max_sharing_saved_mib"] = max(s["kv_cache_sharing_saved_bytes"] for s in busy) / 2**20
    if len(samples) >= 2:
        queries = samples[-1]["prefix_cache_queries"] - samples[0]["prefix_cache_queries"]
        hits = samples[-1]["prefix_cache_hits"] - samples[0]["prefix_cache_hits"]
        out["prefix_cache_hit_rate"] = hits / queries if queries > 0 else 0.0
    return out
