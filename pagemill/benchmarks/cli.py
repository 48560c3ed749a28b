"""`bench throughput|latency|serve|speculative|embed` sub-commands for the pagemill CLI (modelled on `vllm bench`)."""

from __future__ import annotations

import argparse
from typing import Any, Sequence


def _run(module: str, func: str) -> Any:
    """A `func` default that imports the command's module only when the command runs."""

    def runner(args: argparse.Namespace) -> Any:
        import importlib

        return getattr(importlib.import_module(f"pagemill.benchmarks.{module}"), func)(args)

    return runner


def register_bench_subcommands(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` with `throughput`, `latency`, `serve`, `speculative`, `lora`, `embed` and `report` to an argparse sub-parser set."""
    from pagemill.benchmarks.embed import add_embed_args
    from pagemill.benchmarks.latency import add_latency_args
    from pagemill.benchmarks.lora import add_lora_args
    from pagemill.benchmarks.results_page import add_report_args
    from pagemill.benchmarks.serve import add_serve_args
    from pagemill.benchmarks.speculative import add_speculative_args
    from pagemill.benchmarks.throughput import add_throughput_args

    bench = subparsers.add_parser("bench", help="benchmark pagemill against its baselines")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="{throughput,latency,serve,speculative,lora,embed,report}")
    bench_sub.required = True
    for name, add_args, module, func, help_text in (
        ("throughput", add_throughput_args, "throughput", "run_throughput",
         "offline throughput of a request set"),
        ("latency", add_latency_args, "latency", "run_latency", "latency of one batch"),
        ("serve", add_serve_args, "serve", "run_serve",
         "load-test an OpenAI-compatible server"),
        ("speculative", add_speculative_args, "speculative", "run_speculative",
         "decode tok/s with and without speculative decoding on edit, sharegpt and code workloads"),
        ("lora", add_lora_args, "lora", "run_lora",
         "decode tok/s of a batch over several LoRA adapters vs the base model"),
        ("embed", add_embed_args, "embed", "run_embed",
         "embeddings/s of mixed-length texts: the pooling runner vs HF batched encode"),
        ("report", add_report_args, "results_page", "run_report",
         "render docs/benchmarks/index.md (current numbers) from benchmarks/results/*.json"),
    ):
        parser = bench_sub.add_parser(name, help=help_text,
                                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_args(parser)
        parser.set_defaults(func=_run(module, func))
    return bench


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone `pagemill` parser holding only the `bench` sub-commands."""
    parser = argparse.ArgumentParser(prog="pagemill")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register_bench_subcommands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Stand-alone entry: `python -m pagemill.benchmarks.cli bench <command> ...`."""
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
