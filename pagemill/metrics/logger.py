"""A periodic log line while the engine is busy: throughput, queue sizes, KV usage, prefix-cache hits, followed by
the KV accounting line (metrics/kv_cache.py) and, with speculative decoding, vLLM's `SpecDecoding metrics` line for
the same interval."""

from __future__ import annotations

import logging

from pagemill.metrics.kv_cache import kv_log_line
from pagemill.metrics.spec_decode import spec_delta, spec_log_line
from pagemill.metrics.stats import IterationStats, SchedulerStats, SpecDecodingStats

logger = logging.getLogger("pagemill.metrics")


class LoggingStatLogger:
    """Logs at most every `interval_s` seconds, and only when something happened since the last line."""

    def __init__(self, interval_s: float = 10.0, now: float = 0.0, engine_index: int | None = None) -> None:
        self.interval_s = interval_s
        self.prefix = "" if engine_index is None else f"Engine {engine_index:03d}: "  # vLLM's, with DP
        self.last_log = now
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last_stats: SchedulerStats | None = None
        self.last_memory: dict[str, float] | None = None  # the latest KV accounting (not every snapshot has one)
        self._hits_at_log = 0
        self._queries_at_log = 0
        self._spec_at_log: SpecDecodingStats | None = None

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats, now: float,
               engine_idx: int = 0) -> None:
        """Account one batch of outputs and log if the interval has passed."""
        self.prompt_tokens += iteration.num_prompt_tokens
        self.generation_tokens += iteration.num_generation_tokens
        if scheduler_stats is not None:
            self.last_stats = scheduler_stats
            if scheduler_stats.memory is not None:
                self.last_memory = scheduler_stats.memory
        if now - self.last_log >= self.interval_s:
            self.log(now)

    def log(self, now: float) -> None:
        """Emit the line for the interval that ends now (skipped if the interval was idle)."""
        s = self.last_stats
        busy = self.prompt_tokens or self.generation_tokens or \
            (s and (s.num_running_reqs or s.num_waiting_reqs or s.num_swapped_reqs))
        elapsed = max(now - self.last_log, 1e-9)
        if busy and s is not None:
            queries = s.prefix_cache_queries - self._queries_at_log
            hits = s.prefix_cache_hits - self._hits_at_log
            logger.info(
                self.prefix + "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, "
                "Swapped: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                self.prompt_tokens / elapsed, self.generation_tokens / elapsed, s.num_running_reqs,
                s.num_swapped_reqs, s.num_waiting_reqs, 100 * s.kv_cache_usage,
                100 * hits / queries if queries > 0 else 0.0)
            self._queries_at_log, self._hits_at_log = s.prefix_cache_queries, s.prefix_cache_hits
            if self.last_memory is not None:
                logger.info(self.prefix + kv_log_line(self.last_memory))
        if s is not None and s.spec_decoding is not None:
            spec = spec_delta(s.spec_decoding, self._spec_at_log)
            if spec.num_drafts > 0:
                logger.info(self.prefix + spec_log_line(spec, elapsed))
            self._spec_at_log = spec_delta(s.spec_decoding, None)  # a copy: the engine may update its own
        self.last_log = now
        self.prompt_tokens = self.generation_tokens = 0
