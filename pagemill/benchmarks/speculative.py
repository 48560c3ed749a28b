"""`bench speculative`: decode tok/s with and without speculative decoding (issue 13's performance section).

One process loads the model twice: a baseline engine (no speculation) that stays up, and one engine per
`--methods` entry, loaded in turn. Each cell (workload x batch size) runs greedy, ignore_eos requests of
`--output-len` tokens on the baseline and the speculating engine back to back (ABBA over `--num-iters`), so
both decode the same tokens; the cell reports decode tok/s of each, their ratio, the mean acceptance length
and whether the greedy outputs are token-identical. Batch B runs waves of B concurrent requests.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pagemill.benchmarks.model_path import resolve_model
from pagemill.benchmarks.pagemill_backend import add_engine_args, engine_kwargs
from pagemill.benchmarks.report import check_machine_idle, config_dict, environment_info, save_result
from pagemill.benchmarks.spec_report import format_rates
from pagemill.benchmarks.spec_workloads import WORKLOADS, build_workload
from pagemill.config import SPECULATIVE_METHODS
from pagemill.metrics.spec_decode import spec_delta, spec_summary
from pagemill.metrics.stats import SpecDecodingStats


@dataclass
class Run:
    """One timed generation of a cell's prompts on one engine."""

    outputs: list[list[int]]
    elapsed_s: float
    decode_tokens: int  # output tokens after each request's first
    decode_s: float  # per wave: last token of any request - first token of any request, summed
    spec: SpecDecodingStats | None  # the engine's counters over this run (None: it does not speculate)

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode throughput (prefill and first tokens excluded)."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("inf")

    @property
    def output_tokens_per_s(self) -> float:
        """Output tokens over the wall time of the whole run (prefill included)."""
        return sum(len(o) for o in self.outputs) / self.elapsed_s


def _spec_now(llm: Any) -> SpecDecodingStats | None:
    stats = llm.get_stats().spec_decoding
    return spec_delta(stats, None) if stats is not None else None  # a copy


def timed_run(llm: Any, prompts: Sequence[Sequence[int]], output_len: int, batch_size: int,
              lora_requests: Sequence[Any] | None = None, temperature: float = 0.0) -> Run:
    """ignore_eos generation of `prompts` in waves of `batch_size` concurrent requests (each with its adapter in
    `lora_requests`, if given): greedy, or sampled at `temperature` (top-p 0.95, request i seeded with i)."""
    from pagemill import SamplingParams

    if temperature > 0:
        params = [SamplingParams(temperature=temperature, top_p=0.95, seed=i, max_tokens=output_len, ignore_eos=True)
                  for i in range(len(prompts))]
    else:
        params = [SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)] * len(prompts)
    before = _spec_now(llm)
    outputs: list[list[int]] = []
    decode_tokens, decode_s = 0, 0.0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        wave = llm.generate([{"prompt_token_ids": list(p)} for p in prompts[i:i + batch_size]],
                            params[i:i + batch_size],
                            use_tqdm=False,
                            lora_request=lora_requests[i:i + batch_size] if lora_requests is not None else None)
        outputs += [list(o.outputs[0].token_ids) for o in wave]
        firsts = [o.metrics.first_token_time for o in wave if o.metrics and o.metrics.first_token_time]
        lasts = [o.metrics.last_token_time for o in wave if o.metrics and o.metrics.last_token_time]
        if firsts and lasts:
            decode_tokens += sum(max(0, len(o.outputs[0].token_ids) - 1) for o in wave)
            decode_s += max(lasts) - min(firsts)
    elapsed = time.perf_counter() - start
    after = _spec_now(llm)
    return Run(outputs, elapsed, decode_tokens, decode_s, spec_delta(after, before) if after is not None else None)


def cell_prompts(prompts: Sequence[Sequence[int]], num_prompts: int, batch_size: int) -> list[Sequence[int]]:
    """The requests of one batch size: max(1, num_prompts // B) full waves of B (prompts cycle if too few)."""
    count = max(1, num_prompts // batch_size) * batch_size
    return [prompts[k % len(prompts)] for k in range(count)]


def method_config(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """The speculative_config of one method: --speculative-config's extra keys, then the bench's flags."""
    config = {k: v for k, v in (args.speculative_config or {}).items() if k != "method"}
    config["method"] = method
    if args.num_speculative_tokens is not None:
        config["num_speculative_tokens"] = args.num_speculative_tokens
    if method == "draft_model":
        if args.draft_model is not None:
            config["model"] = args.draft_model
        if args.draft_num_layers is not None:
            config["draft_num_layers"] = args.draft_num_layers
    return config


def _median_run(runs: list[Run]) -> Run:
    """The run with the median decode throughput."""
    return sorted(runs, key=lambda r: r.decode_tokens_per_s)[len(runs) // 2]


def _add(a: SpecDecodingStats, b: SpecDecodingStats) -> SpecDecodingStats:
    """The sum of two counter deltas."""
    n = max(len(a.num_accepted_tokens_per_pos), len(b.num_accepted_tokens_per_pos))
    pos = [(a.num_accepted_tokens_per_pos[i] if i < len(a.num_accepted_tokens_per_pos) else 0)
           + (b.num_accepted_tokens_per_pos[i] if i < len(b.num_accepted_tokens_per_pos) else 0) for i in range(n)]
    return SpecDecodingStats(num_spec_tokens=max(a.num_spec_tokens, b.num_spec_tokens),
                             num_drafts=a.num_drafts + b.num_drafts,
                             num_draft_tokens=a.num_draft_tokens + b.num_draft_tokens,
                             num_accepted_tokens=a.num_accepted_tokens + b.num_accepted_tokens,
                             num_accepted_tokens_per_pos=pos)


def _run_metrics(run: Run, runs: list[Run]) -> dict[str, Any]:
    return {"decode_tokens_per_s": run.decode_tokens_per_s, "output_tokens_per_s": run.output_tokens_per_s,
            "elapsed_s": run.elapsed_s, "decode_tokens_per_s_all": [r.decode_tokens_per_s for r in runs]}


def measure_cell(base: Any, spec: Any, prompts: Sequence[Sequence[int]], output_len: int, batch_size: int,
                 num_iters: int, temperature: float = 0.0) -> dict[str, Any]:
    """Time one cell on both engines (ABBA order) and compare their greedy outputs (sampled outputs differ: the
    rejection sampler draws its own random numbers, so `identical` is None)."""
    runs: dict[str, list[Run]] = {"base": [], "spec": []}
    for it in range(num_iters):
        for name in (("base", "spec") if it % 2 == 0 else ("spec", "base")):
            runs[name].append(timed_run(base if name == "base" else spec, prompts, output_len, batch_size,
                                        temperature=temperature))
    b, s = _median_run(runs["base"]), _median_run(runs["spec"])
    reference = runs["base"][0].outputs  # every run of both engines must give these tokens
    identical = sum(all(r.outputs[i] == ref for r in runs["base"] + runs["spec"]) for i, ref in enumerate(reference))
    spec_total = SpecDecodingStats()
    for r in runs["spec"]:
        if r.spec is not None:
            spec_total = _add(spec_total, r.spec)
    return {"batch_size": batch_size, "num_requests": len(prompts), "output_len": output_len,
            "base": _run_metrics(b, runs["base"]), "spec": _run_metrics(s, runs["spec"]),
            "decode_ratio": s.decode_tokens_per_s / b.decode_tokens_per_s,
            "output_ratio": s.output_tokens_per_s / b.output_tokens_per_s,
            "spec_decoding": spec_summary(spec_total),
            "identical_requests": identical if temperature == 0 else None,
            "identical": identical == len(prompts) if temperature == 0 else None}


def _load(kwargs: dict[str, Any]) -> tuple[Any, float]:
    from pagemill import LLM

    start = time.perf_counter()
    llm = LLM(**kwargs)
    return llm, time.perf_counter() - start


def _close(llm: Any) -> None:
    shutdown = getattr(llm, "shutdown", None)
    if callable(shutdown):
        shutdown()
    gc.collect()


def _warm(llm: Any, prompts: Sequence[Sequence[int]]) -> None:
    """Short greedy requests, alone then together (first-call costs of both paths stay out of the timings)."""
    from pagemill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for wave in ([prompts[0]], prompts):
        llm.generate([{"prompt_token_ids": list(p)} for p in wave], params, use_tqdm=False)


def format_cells(cells: list[dict[str, Any]]) -> str:
    """The result table: one line per workload x batch size x method."""
    header = (f"{'workload':<9} {'batch':>5} {'method':<11} {'base tok/s':>10} {'spec tok/s':>10} {'ratio':>6} "
              f"{'acc.len':>7} {'acc.rate':>8} {'identical':>9}  per-position acceptance")
    lines = [header, "-" * len(header)]
    for c in cells:
        sd = c["spec_decoding"]
        lines.append(f"{c['workload']:<9} {c['batch_size']:>5} {c['method']:<11} "
                     f"{c['base']['decode_tokens_per_s']:>10.1f} {c['spec']['decode_tokens_per_s']:>10.1f} "
                     f"{c['decode_ratio']:>5.2f}x {sd['mean_acceptance_length']:>7.2f} "
                     f"{100 * sd['draft_acceptance_rate']:>7.1f}% {str(c['identical']):>9}  "
                     f"{format_rates(sd['per_position_acceptance_rate'])}")
    return "\n".join(lines)


def run_speculative(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point of `bench speculative`."""
    load_at_start = check_machine_idle()
    model = resolve_model(args.model)
    if args.enable_prefix_caching is None:
        args.enable_prefix_caching = False  # repeated prompts must not get free prefills on one engine only
    base_kwargs = {k: v for k, v in engine_kwargs(args, model).items() if k != "speculative_config"}
    base, base_load_s = _load(base_kwargs)
    tokenizer = base.get_tokenizer()
    largest = max(max(args.batch_sizes), args.num_prompts)
    workloads = {w: build_workload(w, tokenizer, largest, args.output_len, args.seed, args.code_prompt_len)
                 for w in args.workloads}
    warm = [p[0] for p in workloads.values()]
    payload: dict[str, Any] = {"benchmark": "speculative", "model": model, "config": config_dict(args),
                               "load_s": {"base": base_load_s}, "cells": []}
    try:
        _warm(base, warm)
        print(format_cells([]), flush=True)
        for method in args.methods:
            config = method_config(args, method)
            spec, load_s = _load({**base_kwargs, "speculative_config": config})
            payload["load_s"][method] = load_s
            try:
                _warm(spec, warm)
                for workload, prompts in workloads.items():
                    for batch_size in args.batch_sizes:
                        cell = measure_cell(base, spec, cell_prompts(prompts, args.num_prompts, batch_size),
                                            args.output_len, batch_size, args.num_iters, args.temperature)
                        cell.update(workload=workload, method=method, speculative_config=config)
                        payload["cells"].append(cell)
                        print(format_cells([cell]).splitlines()[-1], flush=True)
            finally:
                _close(spec)
    finally:
        _close(base)
    payload["environment"] = {**environment_info(), "load_avg_1m_at_start": load_at_start}
    cells = payload["cells"]
    payload["all_identical"] = all(c["identical"] for c in cells) if args.temperature == 0 else None
    print(format_cells(cells))
    print("decode tok/s (first tokens and prefill excluded); ratio = with / without speculation; acc.len = mean "
          "acceptance length (tokens per verification step); acc.rate = accepted / drafted tokens")
    if args.temperature == 0:
        print(f"greedy outputs identical with and without speculation: {payload['all_identical']} "
              f"({sum(c['identical'] for c in cells)}/{len(cells)} cells)")
    else:
        print(f"sampled at temperature {args.temperature} (top-p 0.95, seeded): outputs are not compared")
    if args.save_result:
        save_result(args.save_result, payload)
        print(f"saved {args.save_result}")
    return payload


def _csv(item_type: Callable[[str], Any], choices: Sequence[str] | None = None) -> Callable[[str], list[Any]]:
    """An argparse `type` for comma-separated values."""

    def parse(text: str) -> list[Any]:
        items = [item_type(x.strip()) for x in text.split(",") if x.strip()]
        bad = [x for x in items if choices is not None and x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices or ['values'])}"
                                             f", got {text!r}")
        return items

    return parse


def _positive_ints(text: str) -> list[int]:
    values = _csv(int)(text)
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return values


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench speculative`."""
    parser.add_argument("--model", default=None,
                        help="GGUF file or HF directory; None means the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--methods", type=_csv(str, SPECULATIVE_METHODS), default="ngram,suffix",
                        help="comma-separated speculative methods (ngram, suffix, draft_model); draft_model "
                             "drafts with --draft-model or the target's first --draft-num-layers layers")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="k (default: the method's, 4 for ngram and draft_model, 8 for suffix)")
    parser.add_argument("--draft-model", default=None, help="draft_model: the draft (same tokenizer)")
    parser.add_argument("--draft-num-layers", type=int, default=None,
                        help="draft_model: use only the draft's (default: the target's) first N layers")
    parser.add_argument("--workloads", type=_csv(str, WORKLOADS), default=",".join(WORKLOADS),
                        help="comma-separated: edit (repeat / edit a paragraph), sharegpt (free generation), "
                             "code (continue a Python stdlib module)")
    parser.add_argument("--batch-sizes", type=_positive_ints, default="1,8,32",
                        help="comma-separated concurrent requests per wave")
    parser.add_argument("--num-prompts", type=int, default=8,
                        help="requests per cell: max(1, N // B) waves of B (prompts repeat when N < B)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--code-prompt-len", type=int, default=512, help="prompt tokens of the code workload")
    parser.add_argument("--num-iters", type=int, default=1,
                        help="timed runs per cell and engine (ABBA order); the median is reported")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sharegpt prompts")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (outputs compared); > 0: sampled, top-p 0.95, request i seeded with i "
                             "(lower acceptance: what the back-off is for)")
    parser.add_argument("--save-result", "--output-json", dest="save_result", default=None,
                        help="JSON file for the cells, config and environment")
    add_engine_args(parser)
