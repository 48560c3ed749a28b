"""`bench serve --compare llama.cpp`: start `pagemill serve`, load-test it, stop it; then the same for
llama-server (never both at once), with the same requests and arrival schedule."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any, Sequence

from pagemill.benchmarks.backends import peer_threads
from pagemill.benchmarks.datasets import SampleRequest
from pagemill.benchmarks.llama_cpp import ManagedServer, free_port, llama_server
from pagemill.benchmarks.model_path import default_model_path

# Slack per slot: llama-server re-tokenizes the prompt text, which may differ by a token or two from the
# benchmark tokenizer's count.
SLOT_MARGIN = 64


def peer_model(args: argparse.Namespace) -> str:
    """The GGUF both servers load: --model when it is a local .gguf file, else the embedded default."""
    if args.model and os.path.isfile(args.model):
        if not args.model.endswith(".gguf"):
            raise ValueError(f"--compare llama.cpp needs a GGUF model, got {args.model!r}")
        return args.model
    if args.model:
        raise ValueError(f"--compare llama.cpp needs --model to be a local .gguf file, got {args.model!r}")
    return default_model_path()


def per_slot_ctx(sample_sets: Sequence[Sequence[SampleRequest]]) -> int:
    """Context one llama-server slot needs: the longest prompt + output of any request, plus slack."""
    longest = max((s.prompt_len + s.expected_output_len for samples in sample_sets for s in samples), default=0)
    return longest + SLOT_MARGIN


def pagemill_server_command(model: str, port: int, extra: str | None) -> list[str]:
    """`pagemill serve` for `model` on 127.0.0.1:port, plus --pagemill-serve-args."""
    return [sys.executable, "-m", "pagemill.entrypoints.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), *shlex.split(extra or "")]


def run_compare(args: argparse.Namespace, rates: Sequence[float],
                sample_sets: Sequence[Sequence[SampleRequest]], bench: Any) -> dict[str, list[dict[str, Any]]]:
    """Bench pagemill (started here unless --no-launch-pagemill), then llama-server; return both series.

    `bench(base_url, label, model_name)` runs every rate against one server and returns its metrics.
    """
    model = peer_model(args)
    label = args.label or "pagemill"
    series: dict[str, list[dict[str, Any]]] = {}
    if args.launch_pagemill is False:
        series[label] = bench(args.base_url, label, None)
    else:
        port = free_port()
        server = ManagedServer(pagemill_server_command(model, port, args.pagemill_serve_args), port,
                               "pagemill serve", ready_path="/health", timeout_s=600)
        print(f"starting: {' '.join(server.cmd)} (log {server.log_path})", flush=True)
        with server:
            series[label] = bench(server.base_url, label, None)
    threads = peer_threads(args)
    peer = llama_server(model, threads, args.llama_cpp_parallel, per_slot_ctx(sample_sets),
                        extra=shlex.split(args.llama_cpp_server_args or ""))
    print(f"starting: {' '.join(peer.cmd)} (log {peer.log_path})", flush=True)
    with peer:
        series["llama.cpp"] = bench(peer.base_url, "llama.cpp", None)
    return series


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench serve --compare llama.cpp`."""
    g = parser.add_argument_group("llama.cpp peer (--compare llama.cpp)")
    g.add_argument("--compare", default=None, choices=["llama.cpp"],
                   help="start `pagemill serve`, bench it, stop it; then the same with llama-server on the "
                        "same GGUF; print both results and their ratios")
    g.add_argument("--launch-pagemill", action=argparse.BooleanOptionalAction, default=None,
                   help="with --compare: start `pagemill serve` here (default); --no-launch-pagemill "
                        "benches the server at --base-url instead")
    g.add_argument("--pagemill-serve-args", default="",
                   help="extra flags for the launched `pagemill serve`, e.g. \"--max-num-seqs 16\"")
    g.add_argument("--llama-cpp-parallel", type=int, default=16, help="llama-server slots (-np)")
    g.add_argument("--llama-cpp-threads", type=int, default=None,
                   help="llama-server threads (default: torch's default thread count, as pagemill serve)")
    g.add_argument("--llama-cpp-server-args", default="", help="extra llama-server flags")
