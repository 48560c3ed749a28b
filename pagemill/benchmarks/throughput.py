"""`bench throughput`: offline throughput of a request set, pagemill vs its baselines."""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Sequence

from pagemill.benchmarks.backends import (add_backend_args, apply_peer_defaults, backend_label,
                                          backend_order, close_all, interleaved_times, load_backends,
                                          output_token_count, outputs_of)
from pagemill.benchmarks.datasets import SampleRequest, add_dataset_args, get_samples
from pagemill.benchmarks.model_path import load_hf_tokenizer, resolve_model
from pagemill.benchmarks.pagemill_backend import add_engine_args
from pagemill.benchmarks.peer_report import peer_rows
from pagemill.benchmarks.report import (check_machine_idle, config_dict, environment_info,
                                        format_table, save_result)
from pagemill.benchmarks.spec_report import backend_spec_decoding, spec_rows
from pagemill.benchmarks.variants import PREFIX as VARIANT_PREFIX
from pagemill.benchmarks.variants import ratio_lines


def throughput_metrics(samples: Sequence[SampleRequest], outputs: Sequence[Sequence[int]] | None,
                       elapsed_s: float, output_tokens: int | None = None,
                       input_tokens: int | None = None) -> dict[str, Any]:
    """Request and token rates of one run; output tokens are those actually returned
    (or `output_tokens` when the backend returns no ids); `input_tokens`: the prompts' tokens as the engine counted
    them (image placeholders included), else the samples' lengths."""
    if input_tokens is None:
        input_tokens = sum(s.prompt_len for s in samples)
    if output_tokens is None:
        output_tokens = sum(len(o) for o in outputs or ())
    return {
        "elapsed_s": elapsed_s,
        "num_requests": len(samples),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requested_output_tokens": sum(s.expected_output_len for s in samples),
        "requests_per_s": len(samples) / elapsed_s,
        "input_tokens_per_s": input_tokens / elapsed_s,
        "output_tokens_per_s": output_tokens / elapsed_s,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed_s,
    }


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any]:
    """How many requests got identical greedy tokens from two backends, and the mean common prefix."""
    same = sum(list(x) == list(y) for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n / max(1, max(len(x), len(y))))
    return {"identical_requests": same, "num_requests": len(a),
            "mean_common_prefix_fraction": sum(prefix) / max(1, len(prefix))}


def has_images(samples: Sequence[SampleRequest]) -> bool:
    """Whether any request of the set carries images."""
    return any(s.images for s in samples)


def sample_prompts(samples: Sequence[SampleRequest], names: Sequence[str]) -> list[Any]:
    """What the backends are fed: token ids, or (text, images) for an image dataset (pagemill backends only)."""
    if not has_images(samples):
        return [s.prompt_token_ids or [] for s in samples]
    others = [n for n in names if n != "pagemill" and not n.startswith(VARIANT_PREFIX)]
    if others:
        raise ValueError(f"--dataset-name random-mm runs on pagemill only, not on {', '.join(others)}.")
    return [(s.prompt, list(s.images)) for s in samples]


def measure_backends(args: argparse.Namespace, model: str, samples: Sequence[SampleRequest]
                     ) -> tuple[dict[str, dict[str, Any]], dict[str, list[list[int]] | None]]:
    """Load the backends, time `--num-iters` interleaved runs of all samples on each, close them.

    Returns per-backend metrics (at the median elapsed time) and each backend's output ids
    (None for llama-batched-bench, which returns timings only).
    """
    names = backend_order(args)
    prompts = sample_prompts(samples, names)
    output_lens = [s.expected_output_len for s in samples]
    results: dict[str, dict[str, Any]] = {}
    requests = [(s.prompt_len, s.expected_output_len) for s in samples]
    backends, load_s = load_backends(names, args, model, args.hf_batch_size, requests)
    labels = {name: backend_label(name, args, args.hf_batch_size, b) for name, b in backends.items()}
    try:
        for _ in range(args.num_iters_warmup):
            for backend in backends.values():
                if not getattr(backend, "self_timed", False):  # a fresh process per run: nothing to warm
                    backend.generate(prompts, output_lens)
        hf = backends.get("hf")
        if hf is not None:
            hf.generated_tokens = 0
        times, last = interleaved_times(
            backends, lambda b: b.generate(prompts, output_lens, use_tqdm=not args.disable_tqdm),
            args.num_iters)
        outputs = {name: outputs_of(result) for name, result in last.items()}
        for name in names:
            counted = getattr(backends[name], "last_prompt_tokens", None) if has_images(samples) else None
            metrics = throughput_metrics(samples, outputs[name], statistics.median(times[name]),
                                         output_token_count(last[name]), counted)
            metrics.update(backend=name, description=labels[name],
                           load_s=load_s[name], elapsed_all_s=times[name])
            metrics.update(getattr(last[name], "detail", {}))
            metrics.update(backend_spec_decoding(backends[name]))
            if hf is not None and name == "hf":
                metrics["generated_tokens_incl_batch_padding"] = (
                    hf.generated_tokens // max(1, args.num_iters))
            results[name] = metrics
    finally:
        close_all(backends)
    return results, outputs


def throughput_table(metrics: dict[str, Any]) -> str:
    """Human-readable table of one backend's throughput."""
    rows = [("Requests", metrics["num_requests"]), ("Elapsed, median of runs (s)", metrics["elapsed_s"]),
            ("Total input tokens", metrics["total_input_tokens"]),
            ("Total output tokens", metrics["total_output_tokens"]),
            ("Requests/s", metrics["requests_per_s"]),
            ("Input tokens/s", metrics["input_tokens_per_s"]),
            ("Output tokens/s", metrics["output_tokens_per_s"]),
            ("Total tokens/s", metrics["total_tokens_per_s"]),
            ("Model load (s)", metrics["load_s"])]
    if "generated_tokens_incl_batch_padding" in metrics:
        rows.append(("Tokens generated incl. batch waste", metrics["generated_tokens_incl_batch_padding"]))
    rows += peer_rows(metrics)
    rows += spec_rows(metrics)
    return format_table(f"Throughput: {metrics['backend']}", rows)


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point of `bench throughput`."""
    load_at_start = check_machine_idle()
    apply_peer_defaults(args)
    model = resolve_model(args.model)
    if getattr(args, "structured_output", None):
        from pagemill.benchmarks.structured_output import run_structured_throughput

        if getattr(args, "variant", None):
            raise ValueError("--variant does not combine with --structured-output yet: run the command once per "
                             "engine configuration (each prints constrained vs unconstrained tok/s)")

        payload = run_structured_throughput(args, model)
        payload["environment"] = {**environment_info(), "load_avg_1m_at_start": load_at_start}
        if args.save_result:
            save_result(args.save_result, payload)
            print(f"saved {args.save_result}")
        return payload
    samples = get_samples(args, load_hf_tokenizer(model))
    payload: dict[str, Any] = {"benchmark": "throughput", "model": model,
                               "config": config_dict(args),
                               "results": {}}
    results, outputs = measure_backends(args, model, samples)
    payload["results"] = results
    payload["environment"] = {**environment_info(), "load_avg_1m_at_start": load_at_start}
    for metrics in results.values():
        print(throughput_table(metrics))
    names = list(payload["results"])
    if getattr(args, "variant", None):
        lines = ratio_lines(results, "output_tokens_per_s", True, "output tok/s")
        payload["variant_ratios"] = lines
        print("\n".join(lines))
        first = outputs[names[0]]
        for name in names[1:]:
            if first is not None and outputs[name] is not None:
                same = agreement(first, outputs[name])["identical_requests"]
                print(f"{name} vs {names[0]}: identical greedy outputs {same}/{len(samples)}")
    elif len(names) == 2:
        ours, base = (payload["results"][n] for n in names)
        payload["ratio"] = {
            "output_tokens_per_s": ours["output_tokens_per_s"] / base["output_tokens_per_s"],
            "total_tokens_per_s": ours["total_tokens_per_s"] / base["total_tokens_per_s"],
            "requests_per_s": ours["requests_per_s"] / base["requests_per_s"],
        }
        line = (f"{names[0]} / {names[1]} throughput: "
                f"{payload['ratio']['total_tokens_per_s']:.2f}x total tok/s, "
                f"{payload['ratio']['output_tokens_per_s']:.2f}x output tok/s")
        if outputs[names[0]] is not None and outputs[names[1]] is not None:
            payload["agreement"] = agreement(outputs[names[0]], outputs[names[1]])
            line += (f"; identical greedy outputs: "
                     f"{payload['agreement']['identical_requests']}/{len(samples)} requests")
        print(line)
    if args.save_result:
        save_result(args.save_result, payload)
        print(f"saved {args.save_result}")
    return payload


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench throughput`."""
    add_dataset_args(parser)
    add_backend_args(parser, hf_batch_default=16)
    add_engine_args(parser)
    parser.add_argument("--num-iters", type=int, default=1,
                        help="timed runs per backend (interleaved); the median is reported")
    parser.add_argument("--num-iters-warmup", type=int, default=0)
    parser.add_argument("--save-result", "--output-json", dest="save_result", default=None,
                        help="JSON file for metrics and config")
    parser.add_argument("--disable-tqdm", action="store_true")
    from pagemill.benchmarks.structured_output import add_structured_output_args

    add_structured_output_args(parser)
