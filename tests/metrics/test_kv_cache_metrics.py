"""The KV accounting gauges and log line, fed with scheduler snapshots."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from pagemill.metrics.kv_cache import KV_GAUGES, kv_log_line
from pagemill.metrics.logger import LoggingStatLogger
from pagemill.metrics.prometheus import PrometheusStatLogger
from pagemill.metrics.stats import IterationStats, SchedulerStats
from tests.entrypoints.conftest import parse_metrics

MEMORY = {"token_slots": 900.0, "slots_fragmented": 80.0, "slots_reserved": 20.0, "slots_total": 4000.0,
          "blocks_partial": 30.0, "blocks_shared": 12.0, "blocks_saved_by_sharing": 24.0,
          "bytes_saved_by_sharing": 24 * 2**20, "blocks_used": 62.0}


def _stats(memory: dict[str, float] | None, hits: int = 30, queries: int = 120) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=3, prefix_cache_hits=hits, prefix_cache_queries=queries, memory=memory)


def test_gauges_follow_the_accounting_and_keep_it_between_snapshots():
    p = PrometheusStatLogger(CollectorRegistry(), "m")
    p.record(_stats(MEMORY), IterationStats(), 1.0)
    p.record(_stats(None, hits=90, queries=180), IterationStats(), 2.0)  # a step without the accounting
    m = parse_metrics(p.render().decode())
    assert {key: m[f"pagemill:{name}"] for key, (name, _) in KV_GAUGES.items()} == \
        {key: MEMORY[key] for key in KV_GAUGES}
    assert m["pagemill:kv_cache_prefix_hit_rate"] == 0.5  # the hit rate follows every snapshot
    p.record(_stats({**MEMORY, "token_slots": 0.0, "blocks_shared": 0.0}), IterationStats(), 3.0)
    m = parse_metrics(p.render().decode())
    assert m["pagemill:kv_cache_token_slots"] == 0 and m["pagemill:kv_cache_shared_blocks"] == 0


def test_log_line_divides_the_slots_in_use():
    line = kv_log_line(MEMORY)
    assert line.startswith("KV cache slots in use: 1000 of 4000: token states 900 (90.0%), ")
    assert "internal fragmentation 80 (8.0%) in 30 partly-filled blocks, reserved 20 (2.0%)" in line
    assert line.endswith("blocks shared: 12, saved by sharing: 24 blocks (24.0 MiB)")
    assert "token states 0 (0.0%)" in kv_log_line({k: 0.0 for k in MEMORY})


def test_periodic_log_adds_the_latest_accounting(caplog):
    caplog.set_level(logging.INFO, logger="pagemill.metrics")
    log = LoggingStatLogger(interval_s=10.0, now=0.0)
    log.record(_stats(MEMORY), IterationStats(num_generation_tokens=5), 4.0)
    log.record(_stats(None), IterationStats(num_generation_tokens=5), 10.0)  # the line uses the latest accounting
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "Prefix cache hit rate: 25.0%" in lines[0] and lines[1] == kv_log_line(MEMORY)
    caplog.clear()
    fresh = LoggingStatLogger(interval_s=10.0, now=0.0)
    fresh.record(_stats(None), IterationStats(num_generation_tokens=5), 10.0)  # no accounting seen yet: no line
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache slots")] == []
