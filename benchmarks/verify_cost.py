"""What verifying k draft tokens costs: the target's step (forward + LM head + sampling) over 1 + k tokens of one
request, against a one-token decode step (issue 13: at most 1.3x for 1 + 7 tokens at batch 1).

The target drafts for itself as a separate draft model, so every draft is accepted and every step verifies exactly
1 + k tokens; the draft's own forwards are timed apart (the profiler's `propose` section) and left out.

    python benchmarks/verify_cost.py [--model PATH] [--quantization auto|none|...] [--ks 1,3,7] [--context 512]
                                     [--steps 64]

With the GGUF's Q4_1 records (auto) a one-token step streams 60 MB of weights and eight rows are compute-bound on
two cores; with float32 weights (`--quantization none`, the setting of the issue's torch figures) the one-token step
is bound by reading the weights, and 1 + 7 measured ~1.4x (benchmarks/README.md, session 13).
"""

from __future__ import annotations

import argparse
import platform

from pagemill import LLM, SamplingParams
from pagemill.loader.default_model import default_model_path

SECTIONS = ("forward_ms", "logits_ms", "sample_ms")


def step_cost(model: str, k: int, context: int, steps: int,
              quantization: str = "auto") -> tuple[float, dict[str, float]]:
    """(ms per verifying step, the sections) for one request with `context` prompt tokens, k drafts per step."""
    # No back-off (a negative min_acceptance_rate): a self-draft costs about one target step per token, so the
    # scheduler would (rightly) stop drafting and the "verify" steps would be one-token steps (until 2026-11-24 this
    # script measured that).
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": k,
            "max_batch_size": 1000, "min_acceptance_rate": -2.0} if k else None
    llm = LLM(model, max_model_len=context + 4 * steps * (k + 1), speculative_config=spec, profile=True,
              quantization=quantization)
    prompt = {"prompt_token_ids": [(i * 7919) % 20000 + 100 for i in range(context)]}
    sp = SamplingParams(temperature=0, max_tokens=steps * (k + 1), ignore_eos=True)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2 * (k + 1), ignore_eos=True), use_tqdm=False)
    prof = llm.llm_engine.engine_core.profiler
    prof.reset()
    llm.generate(prompt, sp, use_tqdm=False)
    report = prof.report()
    tokens_per_step = steps * (k + 1) / report["steps"]
    if tokens_per_step < k + 0.5:  # every step must verify 1 + k tokens, or this measures something else
        raise RuntimeError(f"k={k}: {tokens_per_step:.2f} tokens per step, not {k + 1}")
    return sum(report[s] for s in SECTIONS), {s: report[s] for s in SECTIONS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--ks", default="1,3,7")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--quantization", default="auto", help="the engine's quantization (none: float32 weights)")
    args = ap.parse_args()
    model = args.model or default_model_path()
    print(f"CPU: {platform.processor() or platform.machine()}; model {model}; quantization {args.quantization}; "
          f"context {args.context}")
    base, sections = step_cost(model, 0, args.context, args.steps, args.quantization)
    print(f"k=0 (1 token):  {base:7.2f} ms/step  " + "  ".join(f"{s} {v:.2f}" for s, v in sections.items()))
    for k in (int(x) for x in args.ks.split(",")):
        cost, sections = step_cost(model, k, args.context, args.steps, args.quantization)
        print(f"k={k} ({k + 1} tokens): {cost:7.2f} ms/step = {cost / base:.2f}x  "
              + "  ".join(f"{s} {v:.2f}" for s, v in sections.items()))


if __name__ == "__main__":
    main()
