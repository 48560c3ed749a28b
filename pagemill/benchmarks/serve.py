"""`bench serve`: load an OpenAI-compatible streaming endpoint (serve_load.py sends the requests) and report.

Requests arrive as a Poisson (or gamma, `--burstiness`) process at `--request-rate`, optionally
capped by `--max-concurrency`; each streams its answer and the client records chunk times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from typing import Any, Sequence

from pagemill.benchmarks.datasets import SampleRequest, add_dataset_args, get_samples
from pagemill.benchmarks.kv_metrics import KVSampler, kv_summary
from pagemill.benchmarks.metrics import RequestResult, compute_metrics, parse_goodput
from pagemill.benchmarks.model_path import default_model_path, load_hf_tokenizer
from pagemill.benchmarks.openai_client import build_payload, send_request
from pagemill.benchmarks.report import check_machine_idle, config_dict, environment_info, save_result
from pagemill.benchmarks.serve_load import choose_model_name, run_load, served_model_names
from pagemill.benchmarks.serve_report import serve_table
from pagemill.benchmarks.serve_structured import run_structured_serve
from pagemill.benchmarks.server_metrics import fetch_spec_counters
from pagemill.metrics.spec_decode import spec_delta, spec_summary


def tokenizer_source(args: argparse.Namespace) -> str:
    """Where to load the tokenizer from: --tokenizer, else a local --model path, else the default."""
    if args.tokenizer:
        return args.tokenizer
    if args.model and os.path.exists(args.model):
        return args.model
    return default_model_path()


def _rates(args: argparse.Namespace) -> list[float]:
    if args.sweep_rates:
        return [float(r) for r in args.sweep_rates.split(",") if r.strip()]
    return [float(args.request_rate)]


async def _initial_test(url: str, model: str, chat: bool,
                        extra_body: dict[str, Any] | None) -> None:
    import aiohttp

    # A prompt outside the data set, so that no benchmark prompt is already in a prefix cache.
    probe = SampleRequest("Say hello.", 0, 4)
    payload = build_payload(probe, model, chat, True, 0.0, extra_body)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        result = await send_request(session, url, payload, 0, chat)
    if not result.success:
        raise RuntimeError(f"initial test request to {url} failed: {result.error}")


def _details(results: Sequence[RequestResult]) -> dict[str, list[Any]]:
    ok = [r.success and bool(r.chunk_times) for r in results]
    return {
        "ttfts_s": [r.ttft if good else None for r, good in zip(results, ok)],
        "e2els_s": [r.e2el if good else None for r, good in zip(results, ok)],
        "itls_s": [r.itls if good else [] for r, good in zip(results, ok)],
        "output_lens": [r.output_tokens for r in results],
        "input_lens": [r.prompt_len for r in results],
        "errors": [r.error for r in results],
    }


async def _bench_target(args: argparse.Namespace, base_url: str, label: str,
                        rates: Sequence[float], sample_sets: Sequence[Sequence[SampleRequest]],
                        model_name: str | None = None) -> list[dict[str, Any]]:
    chat = "chat" in args.endpoint
    url = base_url.rstrip("/") + args.endpoint
    model = model_name or choose_model_name(args, await served_model_names(base_url))
    extra_body = json.loads(args.extra_body) if args.extra_body else None
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    if not args.skip_initial_test:
        await _initial_test(url, model, chat, extra_body)
    runs = []
    for rate, samples in zip(rates, sample_sets):
        spec_before = await fetch_spec_counters(base_url)
        sampler = KVSampler(base_url, args.kv_metrics_interval) if args.kv_metrics_plot else None
        async with sampler if sampler is not None else contextlib.nullcontext():
            results, duration = await run_load(
                samples, url, model, chat, rate, args.burstiness, args.max_concurrency,
                args.ignore_eos, args.temperature, args.seed, extra_body, args.disable_tqdm)
        metrics = compute_metrics(results, duration, percentiles, parse_goodput(args.goodput))
        if sampler is not None:
            metrics["kv_metrics"] = {"summary": kv_summary(sampler.samples), "samples": sampler.samples}
        metrics.update(target=label, base_url=base_url, served_model=model, request_rate=rate,
                       burstiness=args.burstiness, max_concurrency=args.max_concurrency)
        spec_after = await fetch_spec_counters(base_url)
        if spec_after is not None and (spec := spec_delta(spec_after, spec_before)).num_drafts > 0:
            metrics["spec_decoding"] = spec_summary(spec)
        if args.save_detailed:
            metrics["requests"] = _details(results)
        errors = sorted({r.error for r in results if r.error})
        if errors:
            metrics["error_samples"] = errors[:5]
        print(serve_table(metrics, [k[1:] for k in metrics["ttft_ms"] if k.startswith("p")],
                          f"Serving Benchmark Result ({label})"))
        runs.append(metrics)
    return runs


def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point of `bench serve`: build the dataset, run every rate and target, report.

    Each rate of a sweep gets its own prompts (seed + index) so that a server's prefix cache
    cannot reuse an earlier run's prompts; every target sees the same prompts per rate.
    """
    if getattr(args, "structured_output", None):
        return run_structured_serve(args)
    load_at_start = check_machine_idle()
    tokenizer = load_hf_tokenizer(tokenizer_source(args))
    rates = _rates(args)

    def sample_sets_for(round_index: int) -> list[list[SampleRequest]]:
        first = args.seed + round_index * len(rates)
        return [get_samples(argparse.Namespace(**{**vars(args), "seed": first + k}), tokenizer)
                for k in range(len(rates))]

    sample_sets = sample_sets_for(0)
    if "chat" not in args.endpoint and any(s.images for samples in sample_sets for s in samples):
        raise ValueError("--dataset-name random-mm sends images: use --endpoint /v1/chat/completions.")
    targets = [("pagemill" if args.label is None else args.label, args.base_url)]
    series: dict[str, list[dict[str, Any]]] = {}
    if args.compare == "llama.cpp":
        from pagemill.benchmarks.serve_peer import run_compare

        series = run_compare(args, rates, sample_sets, lambda url, label, name: asyncio.run(
            _bench_target(args, url, label, rates, sample_sets, name)))
        targets = [(label, "") for label in series]
    elif args.variant:
        from pagemill.benchmarks.serve_variants import run_serve_variants

        series, variant_ratios = run_serve_variants(args, rates, sample_sets_for, lambda url, label, rs, sets: (
            asyncio.run(_bench_target(args, url, label, rs, sets))))
        targets = [(label, "") for label in series]
    elif args.compare_policies:
        from pagemill.benchmarks.serve_policies import policy_rows, policy_table, run_policies

        series = run_policies(args, lambda url, label, name: asyncio.run(
            _bench_target(args, url, label, rates, sample_sets, name)))
        targets = [(label, "") for label in series]
    else:
        if args.baseline_base_url:
            targets.append((args.baseline_label, args.baseline_base_url))
        for label, base_url in targets:
            series[label] = asyncio.run(_bench_target(args, base_url, label, rates, sample_sets))
    payload = {"benchmark": "serve", "config": config_dict(args),
               "environment": {**environment_info(), "load_avg_1m_at_start": load_at_start},
               "runs": [r for v in series.values() for r in v]}
    if args.compare_policies:
        payload["policies"] = policy_rows(series)
        print(policy_table(payload["policies"]))
    if args.variant:
        payload["variant_ratios"] = variant_ratios
    elif len(targets) == 2:
        payload["ratios"] = _ratios(series[targets[0][0]], series[targets[1][0]])
        for row in payload["ratios"]:
            print(f"rate {row['request_rate']:g}: output throughput ratio "
                  f"{row['output_throughput_ratio']:.2f}x, normalized latency ratio "
                  f"{row['normalized_latency_ratio']:.2f}x ({targets[0][0]} / {targets[1][0]})")
    if args.save_result:
        save_result(args.save_result, payload)
        print(f"saved {args.save_result}")
    if args.plot:
        from pagemill.benchmarks.plots import plot_sweep

        plot_sweep(series, args.plot, f"{args.dataset_name} dataset, {args.num_prompts} requests per rate")
        print(f"saved {args.plot}")
    if args.kv_metrics_plot:
        from pagemill.benchmarks.plots import plot_kv_metrics

        runs = [(f"{r['target']} @ {r['request_rate']:g} req/s", r["kv_metrics"]["samples"])
                for r in payload["runs"] if r.get("kv_metrics", {}).get("samples")]
        if runs:
            plot_kv_metrics(runs, args.kv_metrics_plot, f"KV cache accounting, {args.dataset_name} dataset")
            print(f"saved {args.kv_metrics_plot}")
        else:
            print(f"not saved {args.kv_metrics_plot}: no server reported KV accounting in /metrics")
    return payload


def _ratios(ours: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    rows = []
    for a, b in zip(ours, base):
        rows.append({
            "request_rate": a["request_rate"],
            "output_throughput_ratio": a["output_throughput"] / max(b["output_throughput"], 1e-12),
            "normalized_latency_ratio": (a["normalized_latency_s_per_token"]
                                         / max(b["normalized_latency_s_per_token"], 1e-12)),
        })
    return rows


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench serve` (names as in `vllm bench serve`, plus --sweep-rates/--plot)."""
    add_dataset_args(parser)
    parser.add_argument("--model", default=None,
                        help="model name or path (default: the server's only model; tokenizer "
                             "of the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None, help="`model` field to send")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path (GGUF or HF dir)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions",
                        choices=["/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s (inf: send all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of inter-arrival times (1.0 = Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--sweep-rates", default=None,
                        help="comma-separated request rates to run one after another")
    parser.add_argument("--plot", default=None, help="PNG: normalized latency vs request rate")
    parser.add_argument("--kv-metrics-plot", default=None,
                        help="PNG: a pagemill server's KV accounting (/metrics) over each run: token states, "
                             "fragmentation, reservation, sharing, prefix-cache hits (samples go in the JSON)")
    parser.add_argument("--kv-metrics-interval", type=float, default=0.5,
                        help="seconds between /metrics samples for --kv-metrics-plot")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--extra-body", default=None, help="JSON merged into every request")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs, e.g. ttft:500 tpot:50 e2el:10000")
    parser.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    parser.add_argument("--label", default=None, help="name of the target in tables/plots")
    parser.add_argument("--baseline-base-url", default=None,
                        help="also run the same load against this server and print ratios")
    parser.add_argument("--baseline-label", default="baseline")
    parser.add_argument("--skip-initial-test", action="store_true")
    parser.add_argument("--save-result", default=None, help="JSON file for metrics and config")
    parser.add_argument("--save-detailed", action="store_true",
                        help="include per-request timings in the JSON")
    parser.add_argument("--disable-tqdm", action="store_true")
    from pagemill.benchmarks.serve_peer import add_compare_args
    from pagemill.benchmarks.serve_policies import add_policy_args
    from pagemill.benchmarks.serve_variants import add_serve_variant_args
    from pagemill.benchmarks.structured_output import add_structured_output_args

    add_structured_output_args(parser, serve=True)
    add_compare_args(parser)
    add_policy_args(parser)
    add_serve_variant_args(parser)
