"""Async vs synchronous scheduling, side by side: output throughput and the non-forward share of a step at batch 1
and batch 64 (issue 18: async scheduling shrinks the step overhead toward zero).

A step's overhead is 1 - (forward + LM head seconds) / (wall seconds of the run), per step: with async scheduling
the engine's schedule / update / detokenize work runs while the model computes the previous step, so it leaves the
wall time; the runner's own input preparation and sampling stay in it.

    python benchmarks/async_scheduling.py --save-result results/async_scheduling.json
    python benchmarks/async_scheduling.py --model /path/to/hf_dir --batch-sizes 1,8 --output-len 16   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import time

from pagemill import LLM, SamplingParams
from pagemill.benchmarks.report import environment_info, save_result


def measure(llm: LLM, batch: int, input_len: int, output_len: int) -> dict[str, float]:
    """One batch of `batch` prompts of `input_len` tokens, `output_len` greedy tokens each, after a warm-up."""
    prompts = [{"prompt_token_ids": [100 + (i * 7 + j) % 3000 for j in range(input_len)]} for i in range(batch)]
    prof = llm.llm_engine.engine_core.profiler
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    prof.reset()
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True),
                        use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    steps = max(1, prof.steps)
    model = prof.timings.get("forward", 0.0) + prof.timings.get("logits", 0.0)
    sections = {f"{k}_ms": round(1e3 * v / steps, 3) for k, v in sorted(prof.timings.items())}
    return {"output_tok_s": tokens / wall, "wall_s": wall, "steps": steps, "step_ms": 1e3 * wall / steps,
            "model_ms": 1e3 * model / steps, "overhead_fraction": max(0.0, 1 - model / wall), **sections}


def main(argv: list[str] | None = None) -> int:
    """Print throughput and step overhead for each mode and batch size."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--save-result", default=None)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra engine argument, e.g. linear_dtype=float16 (repeatable)")
    args = ap.parse_args(argv)
    extra = {k: int(v) if v.isdigit() else v for k, v in (a.split("=", 1) for a in args.engine_arg)}
    batches = [int(x) for x in args.batch_sizes.split(",")]
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for mode in ("async", "sync"):
        llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, max_model_len=args.input_len + args.output_len + 8,
                  max_num_seqs=max(batches), profile=True, async_scheduling=mode == "async", **extra)
        rows[mode] = {}
        for b in batches:
            r = rows[mode][b] = measure(llm, b, args.input_len, args.output_len)
            print(f"{mode:5s} batch {b:3d}: {r['output_tok_s']:8.1f} tok/s, step {r['step_ms']:.2f} ms "
                  f"(forward + LM head {r['model_ms']:.2f} ms), outside the model {100 * r['overhead_fraction']:.1f}%",
                  flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
    for b in batches:
        s, a = rows["sync"][b], rows["async"][b]
        print(f"batch {b:3d}: async / sync throughput {a['output_tok_s'] / s['output_tok_s']:.3f}x, overhead "
              f"{100 * s['overhead_fraction']:.1f}% -> {100 * a['overhead_fraction']:.1f}%")
    if args.save_result:
        save_result(args.save_result, {"args": vars(args), "results": rows, "environment": environment_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
