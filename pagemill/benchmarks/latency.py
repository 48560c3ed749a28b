"""`bench latency`: end-to-end latency of one fixed batch, with TTFT/decode time at batch size 1."""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import numpy as np

from pagemill.benchmarks.backends import (Backend, add_backend_args, backend_label, backend_order,
                                          make_backend)
from pagemill.benchmarks.datasets import random_dataset
from pagemill.benchmarks.model_path import load_hf_tokenizer, resolve_model
from pagemill.benchmarks.pagemill_backend import add_engine_args
from pagemill.benchmarks.prompts import PromptBuilder
from pagemill.benchmarks.report import config_dict, environment_info, format_table, save_result

PERCENTILES = (10, 25, 50, 75, 90, 99)


def time_batch(backend: Backend, prompts: Sequence[Sequence[int]], output_len: int,
               warmup: int, iters: int) -> list[float]:
    """Seconds per `generate` call of the whole batch, after `warmup` untimed calls."""
    lens = [output_len] * len(prompts)
    for _ in range(warmup):
        backend.generate(prompts, lens)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        backend.generate(prompts, lens)
        times.append(time.perf_counter() - start)
    return times


def latency_stats(times_s: Sequence[float]) -> dict[str, float]:
    """Mean and p10..p99 of latencies, in seconds."""
    arr = np.asarray(times_s, dtype=np.float64)
    stats = {"avg_s": float(arr.mean())}
    stats.update({f"p{p}_s": float(np.percentile(arr, p)) for p in PERCENTILES})
    return stats


def run_backend(name: str, args: argparse.Namespace, model: str,
                prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Load backend `name`, measure its batch latency (and TTFT/decode at batch 1), close it."""
    backend, load_s = make_backend(name, args, model, hf_batch_size=len(prompts))
    try:
        times = time_batch(backend, prompts, args.output_len, args.num_iters_warmup, args.num_iters)
        result: dict[str, Any] = {"backend": name, "description": backend_label(name, args, len(prompts)),
                                  "load_s": load_s, "latencies_s": times, **latency_stats(times)}
        if len(prompts) == 1:
            ttft = float(np.mean(time_batch(backend, prompts, 1, 1, args.num_iters)))
            result["ttft_s"] = ttft
            if args.output_len > 1:
                decode = (result["avg_s"] - ttft) / (args.output_len - 1)
                result["decode_s_per_token"] = decode
                result["decode_tokens_per_s"] = 1.0 / decode if decode > 0 else float("inf")
    finally:
        backend.close()
    return result


def latency_table(result: dict[str, Any]) -> str:
    """Human-readable latency table of one backend."""
    rows: list[tuple[str, Any]] = [("Avg latency (s)", f"{result['avg_s']:.4f}")]
    rows += [(f"P{p} latency (s)", f"{result[f'p{p}_s']:.4f}") for p in PERCENTILES]
    if "ttft_s" in result:
        rows.append(("TTFT, batch 1 (ms)", result["ttft_s"] * 1000))
    if "decode_s_per_token" in result:
        rows.append(("Decode time per token (ms)", result["decode_s_per_token"] * 1000))
        rows.append(("Decode tokens/s", result["decode_tokens_per_s"]))
    rows.append(("Model load (s)", result["load_s"]))
    return format_table(f"Latency: {result['backend']}", rows)


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point of `bench latency`."""
    model = resolve_model(args.model)
    builder = PromptBuilder(load_hf_tokenizer(model))
    samples = random_dataset(builder, args.batch_size, args.input_len, args.output_len, seed=args.seed)
    prompts = [s.prompt_token_ids or [] for s in samples]
    payload: dict[str, Any] = {"benchmark": "latency", "model": model, "config": config_dict(args),
                               "environment": environment_info(), "results": {}}
    for name in backend_order(args):
        result = run_backend(name, args, model, prompts)
        payload["results"][name] = result
        print(latency_table(result))
    names = list(payload["results"])
    if len(names) == 2:
        ours, base = (payload["results"][n] for n in names)
        payload["speedup"] = {"avg_latency": base["avg_s"] / ours["avg_s"]}
        if "decode_s_per_token" in ours and "decode_s_per_token" in base:
            payload["speedup"]["decode_per_token"] = (base["decode_s_per_token"]
                                                      / ours["decode_s_per_token"])
            payload["speedup"]["ttft"] = base["ttft_s"] / ours["ttft_s"]
        print(f"{names[0]} vs {names[1]}: "
              + ", ".join(f"{k} {v:.2f}x faster" for k, v in payload["speedup"].items()))
    if args.save_result:
        save_result(args.save_result, payload)
        print(f"saved {args.save_result}")
    return payload


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench latency` (names as in `vllm bench latency`)."""
    add_backend_args(parser, hf_batch_default=None)
    add_engine_args(parser)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters-warmup", type=int, default=3)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", "--output-json", dest="save_result", default=None,
                        help="JSON file for metrics and config")
