"""The Prometheus stat logger (per-app registries, counters from running totals) and the periodic log line."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from pagemill.metrics.logger import LoggingStatLogger
from pagemill.metrics.prometheus import PrometheusStatLogger
from pagemill.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
from tests.entrypoints.conftest import parse_metrics


def _stats(queries: int, hits: int, preemptions: int = 0, running: int = 1) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=running, num_waiting_reqs=2, kv_cache_usage=0.25, num_blocks_total=100,
                          num_blocks_free=75, prefix_cache_queries=queries, prefix_cache_hits=hits,
                          num_preemptions=preemptions)


def test_two_servers_have_separate_registries():
    a = PrometheusStatLogger(CollectorRegistry(), "a")
    b = PrometheusStatLogger(CollectorRegistry(), "b")  # the global registry would raise "Duplicated timeseries"
    a.record(None, IterationStats(num_prompt_tokens=5), 0.0)
    assert parse_metrics(a.render().decode())["pagemill:prompt_tokens_total"] == 5
    assert parse_metrics(b.render().decode())["pagemill:prompt_tokens_total"] == 0


def test_counters_follow_running_totals_and_histograms_count():
    p = PrometheusStatLogger(CollectorRegistry(), "m")
    p.record(_stats(100, 40, 1), IterationStats(num_prompt_tokens=100, num_generation_tokens=3,
                                                time_to_first_tokens=[0.2, 0.3], queue_times=[0.01, 0.02]), 1.0)
    p.record(_stats(160, 70, 1), IterationStats(num_generation_tokens=2, inter_token_latencies=[0.05, 0.06],
                                                finished=[FinishedRequestStats("stop", 1.5, 10, 4),
                                                          FinishedRequestStats("length", 2.0, 90, 1)]), 2.0)
    m = parse_metrics(p.render().decode())
    assert m["pagemill:prefix_cache_queries_total"] == 160 and m["pagemill:prefix_cache_hits_total"] == 70
    assert m["pagemill:num_preemptions_total"] == 1
    assert m["pagemill:prompt_tokens_total"] == 100 and m["pagemill:generation_tokens_total"] == 5
    assert m["pagemill:num_requests_running"] == 1 and m["pagemill:num_requests_waiting"] == 2
    assert m["pagemill:num_requests_swapped"] == 0
    assert m["pagemill:kv_cache_usage_perc"] == 0.25 and m["pagemill:kv_cache_free_blocks"] == 75
    assert m["pagemill:time_to_first_token_seconds_count"] == 2
    assert m["pagemill:inter_token_latency_seconds_count"] == 2
    assert m["pagemill:request_queue_time_seconds_count"] == 2
    assert m["pagemill:e2e_request_latency_seconds_count"] == 2
    assert abs(m["pagemill:e2e_request_latency_seconds_sum"] - 3.5) < 1e-9
    assert m['pagemill:request_success_total{finished_reason="stop"}'] == 1
    assert m['pagemill:request_success_total{finished_reason="length"}'] == 1


def test_log_line_every_interval_while_busy(caplog):
    caplog.set_level(logging.INFO, logger="pagemill.metrics")
    log = LoggingStatLogger(interval_s=10.0, now=0.0)
    log.record(_stats(100, 50), IterationStats(num_prompt_tokens=200, num_generation_tokens=30), 4.0)
    assert not caplog.records  # not yet 10 s
    log.record(_stats(200, 150), IterationStats(num_generation_tokens=20), 10.0)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "Avg prompt throughput: 20.0 tokens/s" in line and "Avg generation throughput: 5.0 tokens/s" in line
    assert "Running: 1 reqs" in line and "Waiting: 2 reqs" in line and "KV cache usage: 25.0%" in line
    assert "Prefix cache hit rate: 75.0%" in line
    caplog.clear()
    log.record(_stats(200, 150, running=0), IterationStats(), 25.0)  # idle interval with work left: still logs
    assert len(caplog.records) == 1 and "Avg generation throughput: 0.0 tokens/s" in caplog.records[0].getMessage()
    caplog.clear()
    idle = SchedulerStats()
    log.record(idle, IterationStats(), 40.0)  # nothing ran or waited: no line
    assert not caplog.records
