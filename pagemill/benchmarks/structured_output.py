"""`bench throughput --structured-output json|regex|choice`: the cost of constrained decoding.

One command runs a small built-in set of constrained requests twice on one engine: with their constraints
(greedy, ending when the grammar completes), then without, each request asked for exactly the tokens its
constrained run produced (ignore_eos), so both runs decode the same number of tokens; `--num-iters` pairs of runs,
interleaved, the median reported. Reports output tok/s, mean TPOT, the constrained/unconstrained ratio and how many
constrained outputs are valid.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from typing import Any, Sequence

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice")

_PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 4}},
    "required": ["name", "age", "email", "skills"], "additionalProperties": False}
_PRODUCT = {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "title": {"type": "string", "maxLength": 40},
    "price": {"type": "number", "minimum": 0, "maximum": 10000},
    "category": {"enum": ["books", "tools", "toys", "food"]}, "in_stock": {"type": "boolean"}},
    "required": ["sku", "title", "price", "category", "in_stock"], "additionalProperties": False}
_EVENT = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40}, "date": {"type": "string", "format": "date"},
    "attendees": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 1, "maxItems": 3}},
    "required": ["title", "date", "attendees"], "additionalProperties": False,
    "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                         "role": {"enum": ["host", "guest"]}},
                         "required": ["name", "role"], "additionalProperties": False}}}

# (prompt, constraint kwargs of StructuredOutputsParams) per kind
DATASET: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "json": [("Describe a software engineer as JSON.", {"json": _PERSON}),
             ("Give a product from a hardware store as JSON.", {"json": _PRODUCT}),
             ("Plan a team meeting as a JSON event.", {"json": _EVENT}),
             ("Describe a teacher as JSON.", {"json": _PERSON})],
    "regex": [("Write a US phone number.", {"regex": r"\(\d{3}\) \d{3}-\d{4}"}),
              ("Give an IPv4 address.", {"regex": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"}),
              ("Write an ISO date and time.", {"regex": r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"}),
              ("Write a short sentence about the sea.", {"regex": r"[A-Z][a-z]+( [a-z]+){3,12}\."})],
    "choice": [("Is this review positive or negative? 'I loved it.'", {"choice": ["positive", "negative", "neutral"]}),
               ("Which is a fruit?", {"choice": ["apple", "carrot", "potato"]}),
               ("Pick a color for the sky.", {"choice": ["blue", "green", "red", "yellow"]}),
               ("Answer yes or no: is fire cold?", {"choice": ["yes", "no"]})],
}


def is_valid(kind: str, constraint: dict[str, Any], text: str) -> bool:
    """Whether an output satisfies its constraint (JSON: parses and validates when jsonschema is installed)."""
    if kind == "choice":
        return text in constraint["choice"]
    if kind == "regex":
        return re.fullmatch(constraint["regex"], text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return True
    try:
        jsonschema.validate(value, constraint["json"], format_checker=jsonschema.FormatChecker())
        return True
    except jsonschema.ValidationError:
        return False


def _tpot(outputs: Sequence[Any]) -> float | None:
    """Mean time per output token after the first, over requests with more than one token (seconds)."""
    values = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
              for o in outputs if o.metrics is not None and o.metrics.first_token_time is not None
              and o.metrics.last_token_time is not None and len(o.outputs[0].token_ids) > 1]
    return statistics.mean(values) if values else None


def _run(llm: Any, prompts: list[dict], params: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    tpot = _tpot(outputs)
    return outputs, {"elapsed_s": elapsed, "total_output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
                     "mean_tpot_ms": None if tpot is None else 1e3 * tpot}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per metric, the median over the timed iterations (each iteration's values kept under "iterations")."""
    out: dict[str, Any] = {}
    for k in runs[0]:
        values = [r[k] for r in runs if r[k] is not None]
        out[k] = statistics.median(values) if values else None
    out["iterations"] = runs
    return out


def run_structured_throughput(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Constrained vs unconstrained throughput of the built-in request set of `args.structured_output`."""
    from pagemill import LLM, SamplingParams
    from pagemill.benchmarks.pagemill_backend import engine_kwargs
    from pagemill.sampling_params import StructuredOutputsParams

    kind = args.structured_output
    items = [DATASET[kind][k % len(DATASET[kind])] for k in range(args.num_prompts)]
    llm = LLM(**engine_kwargs(args, model))
    render = llm.render_chat
    prompts = [{"prompt_token_ids": render([{"role": "user", "content": text}])} for text, _ in items]
    constrained = [SamplingParams(temperature=0.0, max_tokens=args.random_output_len,
                                  structured_outputs=StructuredOutputsParams(**c)) for _, c in items]
    # Compile every grammar first (cached by the engine): the timed run measures decoding, not compilation.
    first = {json.dumps(c, sort_keys=True): k for k, (_, c) in enumerate(items)}

    def one_token_each() -> float:
        """Seconds to admit and decode one token of each distinct grammar (the first time, compiling it)."""
        start = time.perf_counter()
        llm.generate([prompts[k] for k in first.values()],
                     [SamplingParams(temperature=0.0, max_tokens=1,
                                     structured_outputs=constrained[k].structured_outputs) for k in first.values()],
                     use_tqdm=False)
        return time.perf_counter() - start

    compile_s = one_token_each()
    cached_s = one_token_each()  # the same grammars again: cache hits, so what remains is the 1-token requests
    outs, first_run = _run(llm, prompts, constrained)
    lengths = [max(1, len(o.outputs[0].token_ids)) for o in outs]
    plain = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    runs_with, runs_without = [first_run], [_run(llm, prompts, plain)[1]]
    for _ in range(1, max(1, getattr(args, "num_iters", 1))):  # interleaved, so drifting load hits both alike
        runs_with.append(_run(llm, prompts, constrained)[1])
        runs_without.append(_run(llm, prompts, plain)[1])
    with_so, without = _median(runs_with), _median(runs_without)
    with_so["warmup_compile_s"], with_so["warmup_cached_s"] = compile_s, cached_s
    with_so["valid_outputs"] = sum(is_valid(kind, c, o.outputs[0].text) for (_, c), o in zip(items, outs))
    with_so["stopped_by_grammar"] = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    ratio = with_so["output_tokens_per_s"] / without["output_tokens_per_s"]
    tpot_ratio = (with_so["mean_tpot_ms"] / without["mean_tpot_ms"]
                  if with_so["mean_tpot_ms"] and without["mean_tpot_ms"] else None)
    payload = {"benchmark": "throughput", "structured_output": kind, "model": model, "num_requests": len(items),
               "backend": llm.llm_engine.config.structured_outputs_config.backend,
               "results": {"constrained": with_so, "unconstrained": without},
               "ratio": {"output_tokens_per_s": ratio, "mean_tpot": tpot_ratio}}
    for name, m in payload["results"].items():
        tpot = "n/a" if m["mean_tpot_ms"] is None else f"{m['mean_tpot_ms']:.2f} ms"
        print(f"{name:>13}: {m['total_output_tokens']} output tokens in {m['elapsed_s']:.2f} s = "
              f"{m['output_tokens_per_s']:.1f} tok/s, mean TPOT {tpot}")
    print(f"grammars ({len(first)} distinct), one token each: {compile_s:.3f} s compiling, {cached_s:.3f} s cached")
    overhead = "n/a" if tpot_ratio is None else f"{100 * (tpot_ratio - 1):+.1f}%"
    print(f"structured output ({kind}, backend {payload['backend']}): {ratio:.2f}x the unconstrained output tok/s, "
          f"TPOT {overhead} (median of {len(runs_with)}); "
          f"valid {with_so['valid_outputs']}/{len(items)}, ended by the grammar {with_so['stopped_by_grammar']}")
    return payload


def add_structured_output_args(parser: argparse.ArgumentParser, serve: bool = False) -> None:
    """The `--structured-output` flag (of `bench throughput`, or of `bench serve` with `serve`)."""
    where = ("sent to the server's chat endpoint with vLLM's structured_outputs field (the rate, concurrency and "
             "SLO flags apply to both runs)" if serve else
             "pagemill only (use --engine-arg structured_outputs_backend=... for a backend)")
    parser.add_argument("--structured-output", choices=STRUCTURED_OUTPUT_KINDS, default=None,
                        help="benchmark constrained decoding on a built-in request set (json, regex or choice), "
                             "with and without the constraints; --num-prompts requests, at most "
                             f"--random-output-len tokens each; {where}")
