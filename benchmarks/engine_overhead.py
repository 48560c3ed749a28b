"""Engine overhead: time per step outside the model forward, at batch 1 and batch 64 (issue target: <10% / <5%).

    python benchmarks/engine_overhead.py --save-result results/overhead.json
"""

from __future__ import annotations

import argparse
import sys

from pagemill.benchmarks.report import environment_info, save_result
from pagemill import LLM, SamplingParams


def measure(llm: LLM, batch: int, input_len: int, output_len: int) -> dict[str, float]:
    """Profile a batch of decodes after a warm-up; returns the StepProfiler report."""
    prompts = [{"prompt_token_ids": [100 + (i * 7 + j) % 3000 for j in range(input_len)]} for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    prof = llm.llm_engine.engine_core.profiler
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    prof.reset()
    llm.generate(prompts, sp, use_tqdm=False)
    return prof.report()


def main(argv: list[str] | None = None) -> int:
    """Print the step breakdown for each batch size."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--save-result", default=None)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra engine argument, e.g. linear_dtype=float16 (repeatable)")
    args = ap.parse_args(argv)
    extra = dict(a.split("=", 1) for a in args.engine_arg)
    llm = LLM(kv_cache_memory="1GiB", max_model_len=2048, profile=True, **extra)
    rows = {}
    for b in (int(x) for x in args.batch_sizes.split(",")):
        r = rows[b] = measure(llm, b, args.input_len, args.output_len)
        parts = ", ".join(f"{k[:-3]} {v:.2f}" for k, v in r.items() if k.endswith("_ms") and k != "step_ms")
        print(f"batch {b:3d}: step {r['step_ms']:.2f} ms ({parts}); outside the model (forward + LM head): "
              f"{100 * r['overhead_fraction']:.1f}%", flush=True)
    if args.save_result:
        save_result(args.save_result, {"args": vars(args), "results": rows, "environment": environment_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
