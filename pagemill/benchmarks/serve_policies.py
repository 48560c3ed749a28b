"""`bench serve --compare-policies fcfs,srtf,two-level`: start `pagemill serve --scheduling-policy P` for each
policy in turn (never two at once), send each the same requests on the same arrival schedule, and compare
normalized latency and TTFT (mean and tail) side by side."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

from pagemill.benchmarks.llama_cpp import ManagedServer, free_port
from pagemill.benchmarks.model_path import default_model_path
from pagemill.benchmarks.report import format_table
from pagemill.benchmarks.serve_peer import pagemill_server_command
from pagemill.config import SCHEDULING_POLICIES


def parse_policies(text: str) -> list[str]:
    """The policies of --compare-policies (comma-separated, each known, no repeats)."""
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in SCHEDULING_POLICIES]
    if not policies or unknown or len(set(policies)) != len(policies):
        raise ValueError(f"--compare-policies takes distinct policies among {', '.join(SCHEDULING_POLICIES)}, "
                         f"got {text!r}")
    return policies


def run_policies(args: argparse.Namespace, bench: Callable[[str, str, str | None], list[dict[str, Any]]]
                 ) -> dict[str, list[dict[str, Any]]]:
    """Bench a freshly started server per policy; `bench(base_url, label, model_name)` runs every rate."""
    model = args.model or default_model_path()
    series: dict[str, list[dict[str, Any]]] = {}
    for policy in parse_policies(args.compare_policies):
        port = free_port()
        extra = f"{args.pagemill_serve_args or ''} --scheduling-policy {policy}"
        server = ManagedServer(pagemill_server_command(model, port, extra), port, f"pagemill serve {policy}",
                               ready_path="/health", timeout_s=600)
        print(f"starting: {' '.join(server.cmd)} (log {server.log_path})", flush=True)
        with server:
            series[policy] = bench(server.base_url, policy, None)
    return series


def _tail(stats: dict[str, float]) -> tuple[str, float]:
    """The p99 of a summary if it has one, else its highest percentile."""
    if "p99" in stats:
        return "P99", stats["p99"]
    key = max((k for k in stats if k.startswith("p")), key=lambda k: float(k[1:]), default=None)
    return (key.upper(), stats[key]) if key else ("max", float("nan"))


def policy_rows(series: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (rate, policy): normalized latency and TTFT, mean and tail (ms), and output throughput."""
    rows = []
    for policy, runs in series.items():
        for run in runs:
            nl, ttft = run["normalized_latency_ms"], run["ttft_ms"]
            (tail_name, nl_tail), (_, ttft_tail) = _tail(nl), _tail(ttft)
            rows.append({"policy": policy, "request_rate": run["request_rate"], "tail": tail_name,
                         "normalized_latency_mean_ms": nl["mean"], "normalized_latency_tail_ms": nl_tail,
                         "ttft_mean_ms": ttft["mean"], "ttft_tail_ms": ttft_tail,
                         "output_throughput": run["output_throughput"], "completed": run["completed"]})
    return sorted(rows, key=lambda r: (float(r["request_rate"]), list(series).index(r["policy"])))


def policy_table(rows: Sequence[dict[str, Any]]) -> str:
    """The side-by-side comparison, one section per request rate."""
    lines: list[tuple[str, Any]] = []
    rate = None
    for row in rows:
        if row["request_rate"] != rate:
            rate = row["request_rate"]
            lines.append((f"--rate {rate:g} req/s: norm. latency ms/token, TTFT ms (mean / {row['tail']})", ""))
        lines.append((f"{row['policy']}: normalized latency",
                      f"{row['normalized_latency_mean_ms']:.1f} / {row['normalized_latency_tail_ms']:.1f}"))
        lines.append((f"{row['policy']}: TTFT", f"{row['ttft_mean_ms']:.0f} / {row['ttft_tail_ms']:.0f}"))
    return format_table("Scheduling policies", lines, width=64)


def add_policy_args(parser: argparse.ArgumentParser) -> None:
    """The flag of `bench serve --compare-policies` (the servers take --model and --pagemill-serve-args)."""
    parser.add_argument("--compare-policies", default=None, metavar="P1,P2,...",
                        help="start `pagemill serve --scheduling-policy P` for each policy in turn (with "
                             f"--pagemill-serve-args), bench each with the same requests; policies: "
                             f"{', '.join(SCHEDULING_POLICIES)}")
