"""The Prometheus stat logger (per-app registries, counters from running totals) and the periodic log line."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from pagemill.metrics.logger import LoggingStatLogger
from pagemill.metrics.prometheus import PrometheusStatLogger
from pagemill.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats, SpecDecodingStats
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


def _spec(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> SchedulerStats:
    spec = SpecDecodingStats(num_spec_tokens=len(per_pos), num_drafts=drafts, num_draft_tokens=draft_tokens,
                             num_accepted_tokens=accepted, num_accepted_tokens_per_pos=per_pos)
    return SchedulerStats(num_running_reqs=1, spec_decoding=spec)


def test_spec_decode_counters_follow_cumulative_stats():
    p = PrometheusStatLogger(CollectorRegistry(), "m")
    assert "spec_decode" not in p.render().decode()  # no speculation seen: no spec_decode metrics
    p.record(_spec(10, 30, 12, [7, 4, 1]), IterationStats(), 1.0)
    p.record(_spec(25, 75, 30, [16, 10, 4]), IterationStats(), 2.0)
    p.record(SchedulerStats(num_running_reqs=1), IterationStats(), 3.0)  # a snapshot without spec counters
    m = parse_metrics(p.render().decode())
    assert m["pagemill:spec_decode_num_drafts_total"] == 25
    assert m["pagemill:spec_decode_num_draft_tokens_total"] == 75
    assert m["pagemill:spec_decode_num_accepted_tokens_total"] == 30
    assert [m[f'pagemill:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)] == \
        [16, 10, 4]


def test_spec_decode_counters_exist_from_the_start_when_configured():
    m = parse_metrics(PrometheusStatLogger(CollectorRegistry(), "m", num_spec_tokens=4).render().decode())
    assert m["pagemill:spec_decode_num_drafts_total"] == 0 and m["pagemill:spec_decode_num_accepted_tokens_total"] == 0
    assert [m[f'pagemill:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(4)] == \
        [0] * 4


def test_spec_decode_counters_with_an_engine_object_updated_in_place():
    """An in-process engine may hand over the same stats object every step: increments must still add up."""
    p = PrometheusStatLogger(CollectorRegistry(), "m", num_spec_tokens=2)
    stats = _spec(4, 8, 3, [2, 1])
    p.record(stats, IterationStats(), 1.0)
    spec = stats.spec_decoding
    spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens = 6, 12, 5
    spec.num_accepted_tokens_per_pos[0] = 4
    p.record(stats, IterationStats(), 2.0)
    m = parse_metrics(p.render().decode())
    assert m["pagemill:spec_decode_num_drafts_total"] == 6 and m["pagemill:spec_decode_num_accepted_tokens_total"] == 5
    assert m['pagemill:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 4


def test_spec_decoding_log_line_covers_the_interval(caplog):
    caplog.set_level(logging.INFO, logger="pagemill.metrics")
    log = LoggingStatLogger(interval_s=10.0, now=0.0)
    log.record(_spec(100, 400, 100, [60, 25, 10, 5]), IterationStats(num_generation_tokens=200), 10.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[1] == (
        "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted throughput: 10.00 tokens/s, "
        "Drafted throughput: 40.00 tokens/s, Accepted: 100 tokens, Drafted: 400 tokens, "
        "Per-position acceptance rate: 0.600, 0.250, 0.100, 0.050, Avg Draft acceptance rate: 25.0%")
    caplog.clear()
    # the next interval counts only its own drafts: 50 drafts, 200 draft tokens, 150 accepted, over 20 s
    log.record(_spec(150, 600, 250, [110, 65, 45, 30]), IterationStats(num_generation_tokens=200), 30.0)
    spec_line = caplog.records[-1].getMessage()
    assert "Mean acceptance length: 4.00," in spec_line and "Accepted throughput: 7.50 tokens/s" in spec_line
    assert "Drafted: 200 tokens" in spec_line
    assert "Per-position acceptance rate: 1.000, 0.800, 0.700, 0.500" in spec_line
    assert spec_line.endswith("Avg Draft acceptance rate: 75.0%")
    caplog.clear()
    log.record(_spec(150, 600, 250, [110, 65, 45, 30]), IterationStats(num_generation_tokens=5), 40.0)
    assert [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()] == []  # no drafts: no line
