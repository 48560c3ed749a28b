"""`bench latency`: end-to-end latency of one fixed batch, with TTFT/decode time at batch size 1."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

import numpy as np

from pagemill.benchmarks.backends import (add_backend_args, apply_peer_defaults, backend_label,
                                          backend_order, close_all, interleaved_times, load_backends)
from pagemill.benchmarks.datasets import random_dataset
from pagemill.benchmarks.model_path import load_hf_tokenizer, resolve_model
from pagemill.benchmarks.pagemill_backend import add_engine_args
from pagemill.benchmarks.peer_report import peer_rows
from pagemill.benchmarks.prompts import PromptBuilder
from pagemill.benchmarks.report import (check_machine_idle, config_dict, environment_info,
                                        format_table, save_result)
from pagemill.benchmarks.spec_report import backend_spec_decoding, spec_rows
from pagemill.benchmarks.variants import ratio_lines

PERCENTILES = (10, 25, 50, 75, 90, 99)


def latency_stats(times_s: Sequence[float]) -> dict[str, float]:
    """Mean and p10..p99 of latencies, in seconds."""
    arr = np.asarray(times_s, dtype=np.float64)
    stats = {"avg_s": float(arr.mean())}
    stats.update({f"p{p}_s": float(np.percentile(arr, p)) for p in PERCENTILES})
    return stats


def measure_backends(args: argparse.Namespace, model: str,
                     prompts: Sequence[Sequence[int]]) -> dict[str, dict[str, Any]]:
    """Load the backends, time the batch on each in interleaved iterations, close them.

    At batch size 1 a `max_tokens=1` run gives TTFT, and (mean latency - TTFT) / (output_len - 1)
    the decode time per token. llama.cpp (llama-batched-bench) reports its own T_PP + T_TG for
    the batch (process start and model load excluded); its TTFT run is T_PP alone.
    """
    names = backend_order(args)
    lens = [args.output_len] * len(prompts)
    backends, load_s = load_backends(names, args, model, hf_batch_size=len(prompts),
                                     requests=[(len(p), args.output_len) for p in prompts])
    labels = {name: backend_label(name, args, len(prompts), b) for name, b in backends.items()}
    try:
        for _ in range(args.num_iters_warmup):
            for backend in backends.values():
                if not getattr(backend, "self_timed", False):  # a fresh process per run: nothing to warm
                    backend.generate(prompts, lens)
        times, last = interleaved_times(backends, lambda b: b.generate(prompts, lens), args.num_iters)
        spec = {name: backend_spec_decoding(b) for name, b in backends.items()}
        ttfts: dict[str, list[float]] = {}
        if len(prompts) == 1:
            ttfts, _ = interleaved_times(backends, lambda b: b.generate(prompts, [1]),
                                         max(1, args.num_iters))
    finally:
        close_all(backends)
    results = {}
    for name in names:
        result: dict[str, Any] = {"backend": name, "load_s": load_s[name], "description": labels[name],
                                  "latencies_s": times[name], **latency_stats(times[name])}
        result.update(getattr(last[name], "detail", {}))
        result.update(spec[name])
        if name in ttfts:
            result["ttft_s"] = float(np.mean(ttfts[name]))
            if args.output_len > 1:
                decode = (result["avg_s"] - result["ttft_s"]) / (args.output_len - 1)
                result["decode_s_per_token"] = decode
                result["decode_tokens_per_s"] = 1.0 / decode if decode > 0 else float("inf")
        results[name] = result
    return results


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
    rows += peer_rows(result)
    rows += spec_rows(result)
    return format_table(f"Latency: {result['backend']}", rows)


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point of `bench latency`."""
    load_at_start = check_machine_idle()
    apply_peer_defaults(args)
    model = resolve_model(args.model)
    builder = PromptBuilder(load_hf_tokenizer(model))
    samples = random_dataset(builder, args.batch_size, args.input_len, args.output_len, seed=args.seed)
    prompts = [s.prompt_token_ids or [] for s in samples]
    payload: dict[str, Any] = {"benchmark": "latency", "model": model, "config": config_dict(args),
                               "results": {}}
    payload["results"] = measure_backends(args, model, prompts)
    payload["environment"] = {**environment_info(), "load_avg_1m_at_start": load_at_start}
    for result in payload["results"].values():
        print(latency_table(result))
    names = list(payload["results"])
    if getattr(args, "variant", None):
        results = payload["results"]
        lines = ratio_lines(results, "avg_s", False, "speed, mean latency")
        if all("decode_s_per_token" in r for r in results.values()):
            lines += ratio_lines(results, "decode_s_per_token", False, "decode speed")
            lines += ratio_lines(results, "ttft_s", False, "TTFT")
        payload["variant_ratios"] = lines
        print("\n".join(lines))
    elif len(names) == 2:
        ours, base = (payload["results"][n] for n in names)
        payload["speedup"] = {"avg_latency": base["avg_s"] / ours["avg_s"]}
        if "decode_s_per_token" in ours and "decode_s_per_token" in base:
            payload["speedup"]["decode_per_token"] = (base["decode_s_per_token"]
                                                      / ours["decode_s_per_token"])
            payload["speedup"]["ttft"] = base["ttft_s"] / ours["ttft_s"]
        print(f"speedup of {names[0]} over {names[1]} (>1: {names[0]} is faster): "
              + ", ".join(f"{k} {v:.2f}x" for k, v in payload["speedup"].items()))
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
