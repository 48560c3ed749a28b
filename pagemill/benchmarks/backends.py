"""Construct a benchmark backend by name; all expose `generate(prompts, output_lens)` and `close()`."""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Protocol, Sequence

from pagemill.benchmarks.variants import PREFIX as VARIANT_PREFIX
from pagemill.benchmarks.variants import add_variant_args, variant_backend_names, variant_kwargs, variant_label

BACKENDS = ("pagemill", "hf", "llama.cpp")


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


def default_max_num_seqs(args: argparse.Namespace) -> int:
    """--max-num-seqs, else the engine's default."""
    if getattr(args, "max_num_seqs", None):
        return int(args.max_num_seqs)
    try:
        from pagemill.engine.arg_utils import EngineArgs

        return int(EngineArgs.max_num_seqs)
    except (ImportError, AttributeError):
        return 128


def peer_threads(args: argparse.Namespace) -> int:
    """Threads for llama.cpp: --llama-cpp-threads, else --threads, else torch's thread count."""
    if getattr(args, "llama_cpp_threads", None):
        return int(args.llama_cpp_threads)
    if getattr(args, "threads", None):
        return int(args.threads)
    import torch

    return torch.get_num_threads()


def _make_llama_cpp(args: argparse.Namespace, model: str,
                    requests: Sequence[tuple[int, int]] | None) -> Any:
    from pagemill.benchmarks.llama_cpp_backend import (LlamaBatchedBenchBackend, LlamaServerBackend,
                                                       choose_mode)

    if not model.endswith(".gguf"):
        raise ValueError(f"--compare llama.cpp needs a GGUF model, got {model!r}")
    requests = list(requests or [])
    mode = choose_mode(getattr(args, "llama_cpp_mode", "auto"), [p for p, _ in requests],
                       [o for _, o in requests], default_max_num_seqs(args))
    threads = peer_threads(args)
    if mode == "batched-bench":
        from pagemill.benchmarks.llama_cpp import find_binary

        find_binary("llama-batched-bench")  # fail now, with the build command, not mid-run
        return LlamaBatchedBenchBackend(model, threads)
    parallel = max(1, min(len(requests) or 1, getattr(args, "llama_cpp_parallel", None)
                          or default_max_num_seqs(args)))
    per_slot = max((p + o for p, o in requests), default=2048) + 16
    return LlamaServerBackend(model, threads, parallel, per_slot)


def make_backend(name: str, args: argparse.Namespace, model: str, hf_batch_size: int,
                 requests: Sequence[tuple[int, int]] | None = None) -> tuple[Backend, float]:
    """Build backend `name` for `model`; return it and its load time in seconds.

    `requests` ((prompt len, output len) per request) sizes the llama.cpp peer and picks its mode.
    """
    start = time.perf_counter()
    backend: Any
    if name == "llama.cpp":
        backend = _make_llama_cpp(args, model, requests)
    elif name == "pagemill":
        from pagemill.benchmarks.pagemill_backend import PagemillBackend, engine_kwargs

        backend = PagemillBackend(engine_kwargs(args, model))
    elif name.startswith(VARIANT_PREFIX):
        from pagemill.benchmarks.pagemill_backend import PagemillBackend, engine_kwargs

        backend = PagemillBackend({**engine_kwargs(args, model), **variant_kwargs(args, name)})
    elif name == "hf":
        from pagemill.benchmarks.hf_backend import HFBackend

        backend = HFBackend(model, hf_batch_size)
    else:
        raise ValueError(f"unknown backend {name!r}; choose from {BACKENDS}")
    if isinstance(getattr(backend, "reset_prefix_cache", None), bool):
        backend.reset_prefix_cache = bool(getattr(args, "reset_prefix_cache", False))
    return backend, time.perf_counter() - start


def apply_peer_defaults(args: argparse.Namespace) -> None:
    """With `--compare llama.cpp`, pagemill's prefix cache is off unless asked for: every timed run
    repeats the same prompts, and llama.cpp's runs never reuse a cached prompt (fresh
    llama-batched-bench processes; `cache_prompt: false` to llama-server)."""
    if "llama.cpp" in (args.backend, args.compare) and getattr(args, "enable_prefix_caching", None) is None:
        args.enable_prefix_caching = False


def backend_order(args: argparse.Namespace) -> list[str]:
    """The backend under test first (or each `--variant`, in order), then the `--compare` baseline if different."""
    variants = variant_backend_names(args)
    if variants:
        if args.backend != "pagemill":
            raise ValueError("--variant runs pagemill configurations: leave --backend at pagemill")
        return variants + ([args.compare] if args.compare and args.compare != "pagemill" else [])
    names = [args.backend]
    if args.compare and args.compare != args.backend:
        names.append(args.compare)
    return names


def backend_label(name: str, args: argparse.Namespace, hf_batch_size: int,
                  backend: Any = None) -> str:
    """Short description of a backend's configuration for tables and JSON."""
    if backend is not None and callable(getattr(backend, "describe", None)):
        return backend.describe()
    if name.startswith(VARIANT_PREFIX):
        return variant_label(args, name)
    if name == "hf":
        return f"hf transformers float32 generate, static batches of {hf_batch_size}"
    caching = {None: "", True: ", prefix caching on", False: ", prefix caching off"}
    return (f"pagemill LLM, dtype={args.dtype or 'engine default'}"
            f"{caching[getattr(args, 'enable_prefix_caching', None)]}")


def add_backend_args(parser: argparse.ArgumentParser, hf_batch_default: int | None) -> None:
    """--backend / --compare / --hf-batch-size / --model shared by throughput and latency."""
    parser.add_argument("--model", default=None,
                        help="GGUF file or HF directory; None means the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--backend", default="pagemill", choices=BACKENDS)
    parser.add_argument("--compare", default=None, choices=BACKENDS,
                        help="also run this baseline on the same requests and print the ratio")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads before loading (default: torch's choice)")
    g = parser.add_argument_group("llama.cpp peer (--compare llama.cpp)")
    g.add_argument("--llama-cpp-mode", default="auto", choices=("auto", "batched-bench", "server"),
                   help="batched-bench: llama-batched-bench timings (fixed lengths only); server: "
                        "llama-server, all requests at once; auto: batched-bench when lengths are fixed "
                        "and the requests fit one batch of --max-num-seqs")
    g.add_argument("--llama-cpp-threads", type=int, default=None,
                   help="llama.cpp threads (default: --threads, else torch's thread count)")
    g.add_argument("--llama-cpp-parallel", type=int, default=None,
                   help="llama-server slots (default: min(requests, --max-num-seqs or the engine default))")
    add_variant_args(parser)
    if hf_batch_default is not None:
        parser.add_argument("--hf-batch-size", type=int, default=hf_batch_default,
                            help="static batch size of the hf backend")


def load_backends(names: Sequence[str], args: argparse.Namespace, model: str, hf_batch_size: int,
                  requests: Sequence[tuple[int, int]] | None = None
                  ) -> tuple[dict[str, Backend], dict[str, float]]:
    """Load every named backend up front (so timed runs can interleave); also their load times."""
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    backends: dict[str, Backend] = {}
    load_s: dict[str, float] = {}
    try:
        for name in names:
            backends[name], load_s[name] = make_backend(name, args, model, hf_batch_size, requests)
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
    machine hit every backend alike; return the seconds per call and each backend's last result.

    A backend that times itself (llama-batched-bench) returns a `TimedOutputs`: its own seconds
    replace the wall time (process start and model load excluded) and its `outputs` are the result.
    """
    names = list(backends)
    times: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, Any] = {}
    for it in range(iters):
        for name in (names if it % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            result = run(backends[name])
            elapsed = time.perf_counter() - start
            seconds = getattr(result, "seconds", None)
            if seconds is not None and hasattr(result, "outputs"):
                elapsed = float(seconds)
            last[name] = result
            times[name].append(elapsed)
    return times, last


def outputs_of(result: Any) -> list[list[int]] | None:
    """Token ids of a run's result (None for a self-timed run without them)."""
    return result.outputs if hasattr(result, "seconds") and hasattr(result, "outputs") else result


def output_token_count(result: Any) -> int:
    """Output tokens of a run's result."""
    if hasattr(result, "output_tokens"):
        return int(result.output_tokens)
    return sum(len(o) for o in result)
