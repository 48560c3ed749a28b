"""The result table of one `bench serve` run, laid out as `vllm bench serve` prints it."""

from __future__ import annotations

from typing import Any, Sequence

from pagemill.benchmarks.metrics import LATENCY_METRICS
from pagemill.benchmarks.report import format_table
from pagemill.benchmarks.spec_report import spec_rows


def serve_table(metrics: dict[str, Any], percentiles: Sequence[str], title: str) -> str:
    """Format one run's metrics like `vllm bench serve` does."""
    rows: list[tuple[str, Any]] = [
        ("Successful requests", metrics["completed"]),
        ("Failed requests", metrics["failed"]),
        ("Request rate (req/s)", f"{metrics['request_rate']:g}"),
        ("Benchmark duration (s)", metrics["duration_s"]),
        ("Total input tokens", metrics["total_input_tokens"]),
        ("Total generated tokens", metrics["total_output_tokens"]),
        ("Request throughput (req/s)", metrics["request_throughput"]),
        ("Output token throughput (tok/s)", metrics["output_throughput"]),
        ("Total token throughput (tok/s)", metrics["total_token_throughput"]),
        ("Normalized latency (s/token)", f"{metrics['normalized_latency_s_per_token']:.4f}"),
    ]
    if "request_goodput" in metrics:
        rows.append(("Request goodput (req/s)", metrics["request_goodput"]))
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for metric in LATENCY_METRICS:
        stats = metrics[f"{metric}_ms"]
        rows.append((f"--{names[metric]}", ""))
        rows.append((f"Mean {metric.upper()} (ms)", stats["mean"]))
        rows.append((f"Median {metric.upper()} (ms)", stats["median"]))
        rows.append((f"Std {metric.upper()} (ms)", stats["std"]))
        for p in percentiles:
            rows.append((f"P{p} {metric.upper()} (ms)", stats[f"p{p}"]))
    if "normalized_latency_ms" in metrics:  # E2EL / output tokens, per request
        stats = metrics["normalized_latency_ms"]
        rows.append(("--Normalized Latency (E2EL / output tokens)", ""))
        rows.append(("Mean normalized latency (ms/token)", stats["mean"]))
        rows.append(("Median normalized latency (ms/token)", stats["median"]))
        for p in percentiles:
            rows.append((f"P{p} normalized latency (ms/token)", stats[f"p{p}"]))
    rows += spec_rows(metrics)  # a pagemill server that speculated: its /metrics counters over the run
    kv = metrics.get("kv_metrics", {}).get("summary", {})
    if "mean_token_states_pct_of_used" in kv:  # --kv-metrics-plot: the KV accounting sampled over the run
        rows.append(("--KV Cache (mean over the run)", ""))
        rows.append(("Slots in use (% of cache)", kv["mean_used_slots_pct"]))
        rows.append(("Token states (% of used)", kv["mean_token_states_pct_of_used"]))
        rows.append(("Internal fragmentation (% of used)", kv["mean_fragmentation_pct_of_used"]))
        rows.append(("Reservation (% of used)", kv["mean_reservation_pct_of_used"]))
        rows.append(("Blocks shared", kv["mean_shared_blocks"]))
    if "prefix_cache_hit_rate" in kv:
        rows.append(("Prefix cache hit rate (%)", 100 * kv["prefix_cache_hit_rate"]))
    return format_table(title, rows)
