"""Construct a benchmark backend by name; all expose `generate(prompts, output_lens)` and `close()`."""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Protocol, Sequence

BACKENDS = ("pagemill", "hf")


class Backend(Protocol):
    """What throughput/latency benchmarks need from an engine."""

    name: str

    def generate(self, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
                 use_tqdm: bool = False) -> list[list[int]]:
        """Greedy output token ids (exactly `output_lens[i]` each), in input order."""
        ...

    def close(self) -> None:
        """Release the model and its memory."""
        ...


def make_backend(name: str, args: argparse.Namespace, model: str,
                 hf_batch_size: int) -> tuple[Backend, float]:
    """Build backend `name` for `model`; return it and its load time in seconds."""
    start = time.perf_counter()
    backend: Any
    if name == "pagemill":
        from pagemill.benchmarks.pagemill_backend import PagemillBackend, engine_kwargs

        backend = PagemillBackend(engine_kwargs(args, model))
    elif name == "hf":
        from pagemill.benchmarks.hf_backend import HFBackend

        backend = HFBackend(model, hf_batch_size)
    else:
        raise ValueError(f"unknown backend {name!r}; choose from {BACKENDS}")
    return backend, time.perf_counter() - start


def backend_order(args: argparse.Namespace) -> list[str]:
    """The backend under test first, then the `--compare` baseline if different."""
    names = [args.backend]
    if args.compare and args.compare != args.backend:
        names.append(args.compare)
    return names


def backend_label(name: str, args: argparse.Namespace, hf_batch_size: int) -> str:
    """Short description of a backend's configuration for tables and JSON."""
    if name == "hf":
        return f"hf transformers float32 generate, static batches of {hf_batch_size}"
    return f"pagemill LLM, dtype={args.dtype or 'engine default'}"


def add_backend_args(parser: argparse.ArgumentParser, hf_batch_default: int | None) -> None:
    """--backend / --compare / --hf-batch-size / --model shared by throughput and latency."""
    parser.add_argument("--model", default=None,
                        help="GGUF file or HF directory; None means the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--backend", default="pagemill", choices=BACKENDS)
    parser.add_argument("--compare", default=None, choices=BACKENDS,
                        help="also run this baseline on the same requests and print the ratio")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads before loading (default: torch's choice)")
    if hf_batch_default is not None:
        parser.add_argument("--hf-batch-size", type=int, default=hf_batch_default,
                            help="static batch size of the hf backend")


def load_backends(names: Sequence[str], args: argparse.Namespace, model: str,
                  hf_batch_size: int) -> tuple[dict[str, Backend], dict[str, float]]:
    """Load every named backend up front (so timed runs can interleave); also their load times."""
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    backends: dict[str, Backend] = {}
    load_s: dict[str, float] = {}
    try:
        for name in names:
            backends[name], load_s[name] = make_backend(name, args, model, hf_batch_size)
    except BaseException:
        close_all(backends)
        raise
    return backends, load_s


def close_all(backends: dict[str, Backend]) -> None:
    """Close every backend."""
    for backend in backends.values():
        backend.close()


def interleaved_times(backends: dict[str, Backend], run: Callable[[Backend], Any],
                      iters: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Time `run(backend)` `iters` times per backend in ABBA order, so slow phases of a shared
    machine hit every backend alike; return the seconds per call and each backend's last result."""
    names = list(backends)
    times: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, Any] = {}
    for it in range(iters):
        for name in (names if it % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            last[name] = run(backends[name])
            times[name].append(time.perf_counter() - start)
    return times, last
