"""Per-engine Prometheus series (vLLM's `engine` label) on one registry, and the bench's KV sampler over them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pagemill.benchmarks.kv_metrics import parse_kv_sample
from pagemill.metrics.per_engine import PerEngineStatLogger
from pagemill.metrics.prometheus import PrometheusStatLogger
from pagemill.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
from tests.entrypoints.conftest import parse_metrics


def test_each_engine_has_its_own_series():
    registry = CollectorRegistry()
    loggers = PerEngineStatLogger([PrometheusStatLogger(registry, "m", engine_index=i) for i in range(2)])
    memory = {"token_slots": 10.0, "slots_fragmented": 2.0, "slots_reserved": 0.0, "slots_total": 100.0}
    loggers.record(SchedulerStats(num_running_reqs=3, kv_cache_usage=0.5, prefix_cache_hits=30,
                                  prefix_cache_queries=40, memory=memory),
                   IterationStats(num_prompt_tokens=7, finished=[FinishedRequestStats("stop", 1.0, 7, 2)]), 0.0,
                   engine_idx=1)
    loggers.record(SchedulerStats(num_running_reqs=1, prefix_cache_hits=10, prefix_cache_queries=60, memory=memory),
                   IterationStats(num_prompt_tokens=5), 0.0, engine_idx=0)
    m = parse_metrics(loggers.render().decode())
    assert m['pagemill:num_requests_running{engine="0"}'] == 1 and m['pagemill:num_requests_running{engine="1"}'] == 3
    assert m['pagemill:prompt_tokens_total{engine="0"}'] == 5 and m['pagemill:prompt_tokens_total{engine="1"}'] == 7
    assert m['pagemill:request_success_total{engine="1",finished_reason="stop"}'] == 1
    assert 'pagemill:request_success_total{engine="0",finished_reason="stop"}' not in m
    assert m['pagemill:kv_cache_prefix_hit_rate{engine="1"}'] == 0.75
    s = parse_kv_sample(loggers.render().decode())
    assert s["num_requests_running"] == 4 and s["kv_cache_token_slots"] == 20
    assert s["kv_cache_prefix_hit_rate"] == 0.4 and s["kv_cache_usage_perc"] == 0.25  # ratios, not sums
