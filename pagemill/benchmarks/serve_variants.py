"""`bench serve --variant NAME="SERVER FLAGS"` (repeatable): start one `pagemill serve` per variant on loopback,
send each the same requests in ABBA order (`--variant-rounds` passes), and print each variant's ratios to the first.

    pagemill bench serve --num-prompts 32 --request-rate 4 \\
        --variant fcfs="--scheduling-policy fcfs" --variant srtf="--scheduling-policy srtf"

Each round has its own prompts (seed + round), so that no server's prefix cache holds a previous round's prompts;
within a round every variant gets the same prompts on the same arrival schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
from statistics import mean
from typing import Any, Callable, Sequence

from pagemill.benchmarks.llama_cpp import ManagedServer, free_port
from pagemill.benchmarks.model_path import default_model_path
from pagemill.benchmarks.serve_peer import pagemill_server_command
from pagemill.benchmarks.variants import ratio_lines

BenchFn = Callable[[str, str, Sequence[float], Sequence[Sequence[Any]]], list[dict[str, Any]]]


def parse_serve_variants(items: Sequence[str]) -> dict[str, str]:
    """`NAME=FLAGS` items -> {NAME: FLAGS} in the order given; a ValueError names the bad item."""
    variants: dict[str, str] = {}
    for item in items:
        name, sep, flags = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f'--variant expects NAME="SERVER FLAGS", got {item!r}')
        if name in variants:
            raise ValueError(f"--variant {name} is given twice")
        try:
            shlex.split(flags)
        except ValueError as e:
            raise ValueError(f"--variant {name}: {e}") from None
        variants[name] = flags.strip()
    return variants


def abba_order(names: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, name) in ABBA order: even rounds run the names forward, odd rounds backward."""
    if rounds < 1:
        raise ValueError(f"--variant-rounds must be >= 1, got {rounds}")
    return [(r, name) for r in range(rounds) for name in (names if r % 2 == 0 else list(reversed(names)))]


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The mean output throughput and normalized latency (ms/token) of one variant's runs at one rate."""
    return {"output_throughput": mean(r["output_throughput"] for r in runs),
            "normalized_latency_ms": mean(r["normalized_latency_ms"]["mean"] for r in runs),
            "ttft_ms": mean(r["ttft_ms"]["mean"] for r in runs)}


def variant_ratio_lines(summaries: dict[str, dict[str, float]]) -> list[str]:
    """Each variant after the first against the first: throughput and normalized latency ratios (> 1: better)."""
    return (ratio_lines(summaries, "output_throughput", True, "output tok/s")
            + ratio_lines(summaries, "normalized_latency_ms", False, "normalized latency"))


def run_serve_variants(args: argparse.Namespace, rates: Sequence[float],
                       sample_sets_for: Callable[[int], list[list[Any]]], bench: BenchFn
                       ) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Start every variant's server, run the rounds in ABBA order, stop them; return (runs per variant, ratios).

    `sample_sets_for(round)` gives that round's prompts per rate; `bench(base_url, label, rates, sample_sets)` runs
    every rate against one server.
    """
    variants = parse_serve_variants(args.variant)
    model = args.model or default_model_path()
    series: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, flags in variants.items():
            port = free_port()
            extra = f"{args.pagemill_serve_args or ''} {flags}"
            server = ManagedServer(pagemill_server_command(model, port, extra), port, f"pagemill serve {name}",
                                   ready_path="/health", timeout_s=600)
            print(f"starting variant {name}: {' '.join(server.cmd)} (log {server.log_path})", flush=True)
            stack.enter_context(server)
            urls[name] = server.base_url
        for round_index, name in abba_order(list(variants), args.variant_rounds):
            for run in bench(urls[name], name, rates, sample_sets_for(round_index)):
                run["variant_round"] = round_index
                series[name].append(run)
    ratios = []
    for rate in rates:
        summaries = {name: summarize([r for r in runs if r["request_rate"] == rate]) for name, runs in series.items()}
        lines = variant_ratio_lines(summaries)
        ratios.append({"request_rate": rate, "summaries": summaries, "lines": lines})
        for line in lines:
            print(f"rate {rate:g}: {line}")
    return series, ratios


def add_serve_variant_args(parser: argparse.ArgumentParser) -> None:
    """The repeatable `--variant` of `bench serve` and its `--variant-rounds`."""
    parser.add_argument("--variant", action="append", default=None, metavar='NAME="SERVER FLAGS"',
                        help="start `pagemill serve` with these flags (on top of --pagemill-serve-args and "
                             "--model) on loopback and bench it too (repeatable); all variants are started up "
                             "front and loaded in ABBA order, and each one's ratios to the first are printed")
    parser.add_argument("--variant-rounds", type=int, default=2,
                        help="with --variant: passes over the variants (ABBA: every other pass runs them in "
                             "reverse); each pass has its own prompts")
