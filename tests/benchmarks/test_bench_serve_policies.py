"""`bench serve`'s scheduling-policy comparison, normalized-latency tail and KV accounting samples/plot: the
pieces alone, then end to end against real `pagemill serve` processes (tiny random Llama)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from pagemill.benchmarks.cli import build_parser
from pagemill.benchmarks.kv_metrics import kv_summary, parse_kv_sample
from pagemill.benchmarks.metrics import RequestResult, compute_metrics
from pagemill.benchmarks.plots import plot_kv_metrics
from pagemill.benchmarks.serve_policies import parse_policies, policy_rows, policy_table
from pagemill.metrics.prometheus import PrometheusStatLogger
from pagemill.metrics.stats import IterationStats, SchedulerStats

SERVE_ARGS = "--block-size 4 --num-gpu-blocks-override 256 --max-model-len 256 --disable-uvicorn-access-log"


def _sample(t: float, tokens: float, hits: float, queries: float) -> dict[str, float]:
    return {"t": t, "kv_cache_token_slots": tokens, "kv_cache_fragmented_slots": 10.0 if tokens else 0.0,
            "kv_cache_reserved_slots": 0.0, "kv_cache_total_slots": 1000.0, "kv_cache_shared_blocks": 2.0,
            "kv_cache_sharing_saved_bytes": 2 * 2**20, "kv_cache_prefix_hit_rate": hits / max(queries, 1),
            "prefix_cache_hits": hits, "prefix_cache_queries": queries}


def test_normalized_latency_has_mean_and_percentiles():
    results = [RequestResult(0.0, [0.1, 0.1 + 0.01 * k], k + 1, 5, True) for k in range(1, 101)]
    m = compute_metrics(results, 2.0, [50, 99])
    ratios = [r.e2el / r.output_tokens for r in results]
    assert m["normalized_latency_ms"]["mean"] == pytest.approx(1000 * np.mean(ratios))
    assert m["normalized_latency_ms"]["p99"] == pytest.approx(1000 * np.percentile(ratios, 99))
    assert m["normalized_latency_s_per_token"] == pytest.approx(np.mean(ratios))


def test_kv_sample_parses_a_pagemill_metrics_page():
    prom = PrometheusStatLogger(CollectorRegistry(), "m")
    memory = {"token_slots": 30.0, "slots_fragmented": 6.0, "slots_reserved": 4.0, "slots_total": 400.0,
              "blocks_partial": 3.0, "blocks_shared": 2.0, "blocks_saved_by_sharing": 2.0,
              "bytes_saved_by_sharing": 2048.0}
    prom.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, prefix_cache_hits=8, prefix_cache_queries=32,
                               memory=memory), IterationStats(), 0.0)
    s = parse_kv_sample(prom.render().decode())
    assert s["kv_cache_token_slots"] == 30 and s["kv_cache_fragmented_slots"] == 6
    assert s["kv_cache_reserved_slots"] == 4 and s["kv_cache_total_slots"] == 400
    assert s["kv_cache_sharing_saved_bytes"] == 2048 and s["kv_cache_prefix_hit_rate"] == 0.25
    assert (s["prefix_cache_hits"], s["prefix_cache_queries"]) == (8, 32)
    assert (s["num_requests_running"], s["num_requests_waiting"]) == (2, 1)
    assert parse_kv_sample("# nothing\nother_metric 1.0\n") is None  # not a pagemill server


def test_kv_summary_and_plot(tmp_path):
    import matplotlib.image

    samples = [_sample(0.0, 0, 0, 0), _sample(0.5, 90, 10, 100), _sample(1.0, 190, 40, 200), _sample(1.5, 0, 40, 200)]
    summary = kv_summary(samples)
    assert summary["num_busy_samples"] == 2
    assert summary["mean_used_slots_pct"] == pytest.approx(100 * (100 / 1000 + 200 / 1000) / 2)
    assert summary["mean_token_states_pct_of_used"] == pytest.approx(100 * (0.9 + 0.95) / 2)
    assert summary["mean_fragmentation_pct_of_used"] == pytest.approx(100 * (0.1 + 0.05) / 2)
    assert summary["prefix_cache_hit_rate"] == pytest.approx(0.2)
    path = tmp_path / "kv.png"
    plot_kv_metrics([("a @ 1 req/s", samples), ("b @ 1 req/s", samples), ("empty", [])], str(path), "title")
    assert matplotlib.image.imread(str(path)).shape[0] > 600  # two rows of panels: the empty run is left out
    with pytest.raises(ValueError):
        plot_kv_metrics([("empty", [])], str(tmp_path / "none.png"))


def test_policy_list_and_table():
    assert parse_policies("fcfs, srtf,two-level") == ["fcfs", "srtf", "two-level"]
    for bad in ("", "fcfs,sjf", "srtf,srtf"):
        with pytest.raises(ValueError, match="--compare-policies"):
            parse_policies(bad)
    run = {"request_rate": 2.0, "output_throughput": 50.0, "completed": 10,
           "normalized_latency_ms": {"mean": 40.0, "p99": 90.0}, "ttft_ms": {"mean": 300.0, "p99": 900.0}}
    rows = policy_rows({"fcfs": [run], "srtf": [{**run, "ttft_ms": {"mean": 100.0, "p99": 1200.0}}]})
    assert [(r["policy"], r["ttft_mean_ms"], r["ttft_tail_ms"]) for r in rows] == [("fcfs", 300, 900),
                                                                                   ("srtf", 100, 1200)]
    text = policy_table(rows)
    assert "rate 2 req/s" in text and "srtf: TTFT" in text and "100 / 1200" in text and "40.0 / 90.0" in text


def test_bench_serve_compares_policies_on_real_servers(tiny_model, tmp_path):
    """Three servers, one per policy, in turn: each gets the same requests; JSON, tables and both plots."""
    import matplotlib.image

    result, plot, kv_plot = tmp_path / "p.json", tmp_path / "p.png", tmp_path / "kv.png"
    args = build_parser().parse_args([
        "bench", "serve", "--model", tiny_model, "--compare-policies", "fcfs,srtf,two-level",
        "--pagemill-serve-args", SERVE_ARGS + " --max-num-seqs 1", "--num-prompts", "24", "--random-input-len", "24",
        "--random-output-len", "128", "--request-rate", "inf", "--save-result", str(result), "--plot", str(plot),
        "--kv-metrics-plot", str(kv_plot), "--kv-metrics-interval", "0.2", "--disable-tqdm"])
    args.func(args)
    data = json.loads(result.read_text())
    assert [r["target"] for r in data["runs"]] == ["fcfs", "srtf", "two-level"]
    for run in data["runs"]:
        assert run["completed"] == 24 and run["failed"] == 0, run.get("error_samples")
        assert run["total_output_tokens"] == 24 * 128
        assert 0 < run["normalized_latency_ms"]["mean"] <= run["normalized_latency_ms"]["p99"]
        samples = run["kv_metrics"]["samples"]
        assert samples and all(s["kv_cache_total_slots"] == 255 * 4 for s in samples)
        # the accounting is refreshed every 0.25 s while busy and set to zero when the engine drains: 24 requests
        # arriving at once and run one at a time keep it busy for 3,072 decode steps without a gap (~1.2 s; six
        # requests took 0.3 s once a lone greedy row of a float head took the head screen: too close to one
        # refresh), so samples every 0.2 s see slots in use (at 3 req/s a fast machine drained between arrivals
        # and every sample could fall in an idle gap)
        assert max(s["kv_cache_token_slots"] for s in samples) > 0
    assert [r["policy"] for r in data["policies"]] == ["fcfs", "srtf", "two-level"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(str(kv_plot)).shape[0] > 600
