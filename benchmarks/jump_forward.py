"""Jump-forward on JSON-heavy requests: decode speed of constrained requests with and without drafting the tokens
the grammar forces (issue 12).

One process loads three engines on the same model: no speculation; "forced only" (the n-gram proposer with a
lookup of 64 tokens, which never matches these prompts, so every draft is a forced token: jump-forward alone); and
the n-gram proposer at its defaults plus jump-forward. Each runs the JSON requests of `bench throughput
--structured-output json` (greedy, ending when the grammar completes) in waves of `--batch-size`, runs interleaved
over `--num-iters` (median reported); outputs must be token-identical across engines.

    python benchmarks/jump_forward.py [--model PATH] [--batch-sizes 1,4] [--num-prompts 8] [--num-iters 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from pagemill import LLM, SamplingParams
from pagemill.benchmarks.structured_output import DATASET
from pagemill.loader.default_model import default_model_path
from pagemill.sampling_params import StructuredOutputsParams

ENGINES = {
    "no speculation": None,
    "jump-forward only": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 64,
                          "prompt_lookup_max": 64, "min_acceptance_rate": 0.0},
    "ngram + jump-forward": {"method": "ngram", "num_speculative_tokens": 4},
}


def run_waves(llm: LLM, prompts: list[dict], params: list[SamplingParams], batch: int) -> tuple[float, list]:
    """(seconds, outputs) for the requests in waves of `batch`."""
    outs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i:i + batch], params[i:i + batch], use_tqdm=False)
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    model = args.model or default_model_path()
    items = [DATASET["json"][k % len(DATASET["json"])] for k in range(args.num_prompts)]
    engines = {name: LLM(model, speculative_config=spec) for name, spec in ENGINES.items()}
    render = next(iter(engines.values())).render_chat
    prompts = [{"prompt_token_ids": render([{"role": "user", "content": text}])} for text, _ in items]
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                             structured_outputs=StructuredOutputsParams(**c)) for _, c in items]
    for llm in engines.values():  # compile the grammars, warm up
        run_waves(llm, prompts, params, len(prompts))
    print(f"CPU: {platform.machine()} {platform.processor()}; model {model}; {len(prompts)} JSON requests")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        times: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.num_iters):
            for name, llm in engines.items():
                seconds, outs = run_waves(llm, prompts, params, batch)
                times[name].append(seconds)
                tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        ref = tokens["no speculation"]
        total = sum(len(t) for t in ref)
        base = statistics.median(times["no speculation"])
        for name in engines:
            t = statistics.median(times[name])
            same = tokens[name] == ref
            stats = engines[name].llm_engine.engine_core.scheduler.make_stats().spec_decoding
            extra = (f", drafts accepted {stats.num_accepted_tokens} / {stats.num_draft_tokens} (all runs)"
                     if stats is not None and stats.num_draft_tokens else "")
            print(f"batch {batch:>2} {name:>22}: {total / t:7.1f} output tok/s ({t:.2f} s, median of "
                  f"{args.num_iters}) = {base / t:.2f}x; outputs identical: {same}{extra}")


if __name__ == "__main__":
    main()
