"""The paper's §6.4 shared-prefix experiment: throughput with prefix caching on vs off, measured in one run.

Prompts share a 1-shot (80-token) or 5-shot (341-token) prefix followed by a short unique suffix.

    python benchmarks/prefix_sharing.py --num-prompts 64 --save-result results/prefix.json
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from pagemill.benchmarks.report import environment_info, save_result
from pagemill import LLM, SamplingParams
from pagemill.benchmarks.datasets import prefix_dataset
from pagemill.benchmarks.prompts import PromptBuilder


def run(llm: LLM, samples, output_len: int) -> float:
    """Output tokens per second for the whole set, submitted at once."""
    prompts = [{"prompt_token_ids": s.prompt_token_ids} for s in samples]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True), use_tqdm=False)
    return len(samples) * output_len / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    """Alternate on/off runs (ABBA) for each prefix length and report the throughput ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--suffix-len", type=int, default=20)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--prefix-lens", default="80,341")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-result", default=None)
    args = ap.parse_args(argv)
    engines = {on: LLM(kv_cache_memory="1GiB", max_model_len=2048, enable_prefix_caching=on) for on in (True, False)}
    builder = PromptBuilder(engines[True].get_tokenizer())
    rows = []
    for prefix_len in (int(x) for x in args.prefix_lens.split(",")):
        samples = prefix_dataset(builder, args.num_prompts, prefix_len, args.suffix_len, 1, args.output_len, args.seed)
        tps: dict[bool, list[float]] = {True: [], False: []}
        run(engines[True], samples[:2], 2), run(engines[False], samples[:2], 2)  # warm-up
        for r in range(args.repeats):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                engines[on].llm_engine.engine_core.reset_prefix_cache()
                tps[on].append(run(engines[on], samples, args.output_len))
        on, off = float(np.median(tps[True])), float(np.median(tps[False]))
        stats = engines[True].llm_engine.engine_core.get_stats()
        rows.append({"prefix_len": prefix_len, "on_tok_s": on, "off_tok_s": off, "speedup": on / off,
                     "prefix_hit_rate": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries)})
        print(f"prefix {prefix_len:4d} tokens: caching on {on:7.1f} tok/s, off {off:7.1f} tok/s, "
              f"ratio {on / off:.2f}x", flush=True)
    if args.save_result:
        save_result(args.save_result, {"args": vars(args), "rows": rows, "environment": environment_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
