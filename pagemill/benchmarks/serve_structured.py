"""`bench serve --structured-output json|regex|choice`: constrained vs unconstrained serving in one run.

The built-in request set of `bench throughput --structured-output` goes to a running server's chat endpoint: first
one token per distinct constraint (compiling its grammar; then again, cached), then every request with its
constraint (vLLM's `structured_outputs` field; greedy, ending where the grammar does), then the same prompts
without it, each asked for exactly the tokens its constrained answer had (ignore_eos). Both runs share the load
settings (rate, concurrency) and, after the warm-up, a warm prefix cache; TPOT, ITL and throughput are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from pagemill.benchmarks.datasets import SampleRequest
from pagemill.benchmarks.metrics import RequestResult, compute_metrics, parse_goodput
from pagemill.benchmarks.report import check_machine_idle, config_dict, environment_info, save_result
from pagemill.benchmarks.serve_load import choose_model_name, run_load, served_model_names
from pagemill.benchmarks.serve_report import serve_table
from pagemill.benchmarks.structured_output import DATASET, is_valid

CHAT_ENDPOINT = "/v1/chat/completions"


async def _timed_load(args: argparse.Namespace, url: str, model: str, samples: list[SampleRequest],
                      bodies: list[dict[str, Any]] | None, ignore_eos: bool) -> tuple[list[RequestResult], float]:
    return await run_load(samples, url, model, True, args.request_rate, args.burstiness, args.max_concurrency,
                          ignore_eos, 0.0, args.seed, None, args.disable_tqdm, per_request_bodies=bodies)


def _warmup_s(args: argparse.Namespace, url: str, model: str, samples: list[SampleRequest],
              bodies: list[dict[str, Any]]) -> float:
    """Seconds for one token of each distinct constraint, all at once; raises if one fails."""
    one = [SampleRequest(s.prompt, s.prompt_len, 1) for s in samples]
    start = time.perf_counter()
    results, _ = asyncio.run(_timed_load(argparse.Namespace(**{**vars(args), "request_rate": float("inf"),
                                                                "max_concurrency": None, "disable_tqdm": True}),
                                         url, model, one, bodies, False))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"structured-output warm-up request failed: {failed[0]}")
    return time.perf_counter() - start


def run_structured_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Constrained vs unconstrained serving of the built-in request set of `args.structured_output`."""
    load_at_start = check_machine_idle()
    kind = args.structured_output
    items = [DATASET[kind][k % len(DATASET[kind])] for k in range(args.num_prompts)]
    url = args.base_url.rstrip("/") + CHAT_ENDPOINT
    model = choose_model_name(args, asyncio.run(served_model_names(args.base_url)))
    samples = [SampleRequest(text, 0, args.random_output_len) for text, _ in items]
    bodies = [{"structured_outputs": constraint} for _, constraint in items]
    distinct = list({json.dumps(c, sort_keys=True): k for k, (_, c) in enumerate(items)}.values())
    compile_s = _warmup_s(args, url, model, [samples[k] for k in distinct], [bodies[k] for k in distinct])
    cached_s = _warmup_s(args, url, model, [samples[k] for k in distinct], [bodies[k] for k in distinct])

    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    runs: dict[str, dict[str, Any]] = {}
    results, duration = asyncio.run(_timed_load(args, url, model, samples, bodies, False))
    runs["constrained"] = compute_metrics(results, duration, percentiles, parse_goodput(args.goodput))
    runs["constrained"].update(
        valid_outputs=sum(r.success and is_valid(kind, c, r.generated_text) for (_, c), r in zip(items, results)),
        warmup_compile_s=compile_s, warmup_cached_s=cached_s)
    plain = [SampleRequest(s.prompt, 0, max(1, r.output_tokens)) for s, r in zip(samples, results)]
    results, duration = asyncio.run(_timed_load(args, url, model, plain, None, True))
    runs["unconstrained"] = compute_metrics(results, duration, percentiles, parse_goodput(args.goodput))
    for label, metrics in runs.items():
        metrics.update(target=label, base_url=args.base_url, served_model=model, request_rate=args.request_rate,
                       burstiness=args.burstiness, max_concurrency=args.max_concurrency)
        print(serve_table(metrics, [k[1:] for k in metrics["ttft_ms"] if k.startswith("p")],
                          f"Serving Benchmark Result (structured output {kind}: {label})"))
    c, u = runs["constrained"], runs["unconstrained"]
    ratio = {"mean_tpot": c["tpot_ms"]["mean"] / max(u["tpot_ms"]["mean"], 1e-12),
             "output_throughput": c["output_throughput"] / max(u["output_throughput"], 1e-12)}
    print(f"grammars ({len(distinct)} distinct), one token each: {compile_s:.3f} s compiling, {cached_s:.3f} s cached")
    print(f"structured output ({kind}): mean TPOT {c['tpot_ms']['mean']:.2f} ms vs {u['tpot_ms']['mean']:.2f} ms "
          f"unconstrained ({100 * (ratio['mean_tpot'] - 1):+.1f}%), output throughput "
          f"{ratio['output_throughput']:.2f}x; "
          f"valid {c['valid_outputs']}/{len(items)}")
    payload = {"benchmark": "serve", "structured_output": kind, "config": config_dict(args),
               "environment": {**environment_info(), "load_avg_1m_at_start": load_at_start},
               "runs": list(runs.values()), "ratio": ratio}
    if args.save_result:
        save_result(args.save_result, payload)
        print(f"saved {args.save_result}")
    return payload
