"""Prometheus metrics named like vLLM's (`vllm:` -> `pagemill:`), kept in a per-server registry."""

from __future__ import annotations

import weakref
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagemill.metrics.kv_cache import HIT_RATE_GAUGE, KV_GAUGES, hit_rate
from pagemill.metrics.spec_decode import spec_delta
from pagemill.metrics.stats import IterationStats, SchedulerStats, SpecDecodingStats

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]

# Metric families by registry and name: the per-engine loggers of one server share them (data parallelism).
_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Any]] = weakref.WeakKeyDictionary()


def family(registry: CollectorRegistry, kind: type, name: str, doc: str, labelnames: list[str], **kw: Any) -> Any:
    """The registry's metric family `name`, created on first use."""
    families = _FAMILIES.setdefault(registry, {})
    if name not in families:
        families[name] = kind(name, doc, labelnames, registry=registry, **kw)
    return families[name]


class KVCacheGauges:
    """The pagemill:kv_cache_* accounting gauges of one registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str, labels: dict[str, str] | None = None) -> None:
        labels = labels or {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return family(registry, Gauge, f"pagemill:{name}", doc, list(labels)).labels(**labels)

        self.gauges = {key: gauge(name, doc) for key, (name, doc) in KV_GAUGES.items()}
        self.hit_rate = gauge(HIT_RATE_GAUGE, "Prefix-cache hit rate since start: tokens found / tokens looked up.")

    def record(self, stats: SchedulerStats) -> None:
        """Set the gauges from a snapshot (the accounting ones only when it carries the accounting)."""
        self.hit_rate.set(hit_rate(stats.prefix_cache_hits, stats.prefix_cache_queries))
        if stats.memory is not None:
            for key, g in self.gauges.items():
                g.set(stats.memory.get(key, 0))


def metric_labels(model_name: str, engine_index: int | None) -> dict[str, str]:
    """The labels of one engine's series: model_name, and `engine` (vLLM's) with data parallelism."""
    return {"model_name": model_name} if engine_index is None else \
        {"model_name": model_name, "engine": str(engine_index)}


# Counters that SchedulerStats carries as running totals (each feeds the metric of the same name).
_CUMULATIVE = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "external_prefix_cache_queries",
               "external_prefix_cache_hits")


class SpecDecodingCounters:
    """The pagemill:spec_decode_* counters (vLLM's), incremented by the deltas of cumulative SpecDecodingStats."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_spec_tokens: int,
                 labels: dict[str, str] | None = None) -> None:
        labels = labels or {"model_name": model_name}

        def counter(name: str, doc: str) -> Counter:
            return family(registry, Counter, f"pagemill:spec_decode_{name}", doc, list(labels)).labels(**labels)

        self.num_drafts = counter("num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("num_accepted_tokens", "Number of accepted tokens.")
        self._per_pos_family = family(registry, Counter, "pagemill:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", [*labels, "position"])
        self.labels = labels
        self.per_pos = [self._per_pos_family.labels(**labels, position=str(i)) for i in range(num_spec_tokens)]
        self._last: SpecDecodingStats | None = None

    def record(self, stats: SpecDecodingStats) -> None:
        """Add what happened since the previous snapshot."""
        delta = spec_delta(stats, self._last)
        for child, n in ((self.num_drafts, delta.num_drafts), (self.num_draft_tokens, delta.num_draft_tokens),
                         (self.num_accepted_tokens, delta.num_accepted_tokens)):
            if n > 0:
                child.inc(n)
        while len(self.per_pos) < len(delta.num_accepted_tokens_per_pos):
            self.per_pos.append(self._per_pos_family.labels(**self.labels, position=str(len(self.per_pos))))
        for child, n in zip(self.per_pos, delta.num_accepted_tokens_per_pos):
            if n > 0:
                child.inc(n)
        self._last = spec_delta(stats, None)  # a copy: an in-process engine may update its own object


class PrometheusStatLogger:
    """Updates the pagemill:* metrics from scheduler and iteration stats.

    The spec_decode counters exist when `num_spec_tokens` is given (speculation configured) or from the first
    stats that carry speculative decoding counters. `engine_index`: the series of one data-parallel engine (an
    `engine` label, as vLLM's); the loggers of all engines share one registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_spec_tokens: int | None = None,
                 engine_index: int | None = None) -> None:
        self.registry = registry
        self.labels = labels = metric_labels(model_name, engine_index)

        def gauge(name: str, doc: str) -> Gauge:
            return family(registry, Gauge, f"pagemill:{name}", doc, list(labels)).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return family(registry, Counter, f"pagemill:{name}", doc, list(labels)).labels(**labels)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return family(registry, Histogram, f"pagemill:{name}", doc, list(labels), buckets=buckets).labels(**labels)

        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.swapped = gauge("num_requests_swapped", "Number of requests swapped out to host memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent usage.")
        self.kv_free_blocks = gauge("kv_cache_free_blocks", "KV-cache blocks that can be allocated.")
        self.kv_total_blocks = gauge("kv_cache_total_blocks", "Usable KV-cache blocks.")
        self.kv_accounting = KVCacheGauges(registry, model_name, labels)
        self.engine_dead = gauge("engine_dead", "1 once the engine core died (the server then exits), else 0.")
        self.counters = {
            "prefix_cache_queries": counter("prefix_cache_queries", "Prefix-cache queries, in tokens."),
            "prefix_cache_hits": counter("prefix_cache_hits", "Prefix-cache hits, in tokens."),
            "num_preemptions": counter("num_preemptions", "Cumulative number of preemptions."),
            "external_prefix_cache_queries": counter("external_prefix_cache_queries",
                                                     "KV connector queries, in tokens."),
            "external_prefix_cache_hits": counter("external_prefix_cache_hits",
                                                  "KV connector hits (KV loaded instead of computed), in tokens."),
        }
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._success = family(registry, Counter, "pagemill:request_success",
                               "Count of successfully processed requests.", [*labels, "finished_reason"])
        self.model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in the WAITING phase for a request.", _LATENCY_BUCKETS)
        self._last_totals: dict[str, int] = {}
        self.spec_decoding = (SpecDecodingCounters(registry, model_name, num_spec_tokens, labels)
                              if num_spec_tokens is not None else None)

    def set_kv_capacity(self, total_blocks: int) -> None:
        """The pool's size before the first stats arrive (an idle pool: every block free)."""
        self.kv_total_blocks.set(total_blocks)
        self.kv_free_blocks.set(total_blocks)

    def mark_engine_dead(self) -> None:
        """The engine core died: nothing runs or waits any more, and engine_dead says so."""
        for g in (self.running, self.waiting, self.swapped, self.kv_usage, self.kv_free_blocks):
            g.set(0)
        self.engine_dead.set(1)

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats, now: float,
               engine_idx: int = 0) -> None:
        """Account one batch of outputs (of this logger's engine)."""
        if scheduler_stats is not None:
            s = scheduler_stats
            self.running.set(s.num_running_reqs)
            self.waiting.set(s.num_waiting_reqs)
            self.swapped.set(s.num_swapped_reqs)
            self.kv_usage.set(s.kv_cache_usage)
            self.kv_free_blocks.set(s.num_blocks_free)
            self.kv_total_blocks.set(s.num_blocks_total)
            self.kv_accounting.record(s)
            for name in _CUMULATIVE:
                total = getattr(s, name)
                delta = total - self._last_totals.get(name, 0)
                if delta > 0:
                    self.counters[name].inc(delta)
                self._last_totals[name] = total
            if s.spec_decoding is not None:
                if self.spec_decoding is None:
                    self.spec_decoding = SpecDecodingCounters(self.registry, self.model_name,
                                                              s.spec_decoding.num_spec_tokens, self.labels)
                self.spec_decoding.record(s.spec_decoding)
        if iteration.num_prompt_tokens:
            self.prompt_tokens.inc(iteration.num_prompt_tokens)
        if iteration.num_generation_tokens:
            self.generation_tokens.inc(iteration.num_generation_tokens)
        for v in iteration.time_to_first_tokens:
            self.ttft.observe(v)
        for v in iteration.inter_token_latencies:
            self.itl.observe(v)
        for v in iteration.queue_times:
            self.queue_time.observe(v)
        for f in iteration.finished:
            self._success.labels(**self.labels, finished_reason=f.finish_reason).inc()
            self.e2e.observe(f.e2e_latency)

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
