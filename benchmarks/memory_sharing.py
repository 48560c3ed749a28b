"""Reproduce the PagedAttention paper's Fig. 15: KV memory saved by sharing, for parallel sampling and beam search.

Saving = 1 - physical blocks in use / blocks that would be needed without sharing, averaged over engine
steps, on synthetic Alpaca-like and ShareGPT-like length distributions (SmolLM2, block size 16).

    python benchmarks/memory_sharing.py --num-prompts 16 --save-result results/fig15.json
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from pagemill.benchmarks.report import environment_info, save_result
from pagemill import LLM, BeamSearchParams, SamplingParams
from pagemill.benchmarks.datasets import alpaca_dataset, sharegpt_dataset
from pagemill.benchmarks.prompts import PromptBuilder

PAPER = {"alpaca": {"parallel": "6.1-9.8%", "beam": "37.6-55.2%"},
         "sharegpt": {"parallel": "16.2-30.5%", "beam": "44.3-66.3%"}}


class SavingRecorder:
    """Wraps the scheduler's schedule() to sample the sharing saving once every step's blocks are allocated."""

    def __init__(self, llm: LLM) -> None:
        self.scheduler = llm.llm_engine.engine_core.scheduler
        self._schedule = self.scheduler.schedule
        self.samples: list[float] = []
        self.scheduler.schedule = self._record

    def _record(self):
        out = self._schedule()
        mem = self.scheduler.kv_cache_manager.memory_stats()
        if mem["logical_blocks"]:
            self.samples.append(mem["sharing_saving"])
        return out

    def take_mean(self) -> float:
        """Mean saving since the last call."""
        mean = float(np.mean(self.samples)) if self.samples else 0.0
        self.samples = []
        return mean


def main(argv: list[str] | None = None) -> int:
    """Run every (dataset, mode, k) cell and print the table next to the paper's ranges."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-output-len", type=int, default=64, help="cap on sampled output lengths (time)")
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--datasets", default="alpaca,sharegpt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-result", default=None)
    args = ap.parse_args(argv)
    llm = LLM(kv_cache_memory="1GiB", max_model_len=2048, enable_prefix_caching=True)
    builder = PromptBuilder(llm.get_tokenizer())
    recorder = SavingRecorder(llm)
    rows = []
    for name in args.datasets.split(","):
        make = alpaca_dataset if name == "alpaca" else sharegpt_dataset
        samples = make(builder, args.num_prompts, seed=args.seed)
        for k in (int(x) for x in args.ks.split(",")):
            prompts = [{"prompt_token_ids": s.prompt_token_ids} for s in samples]
            params = [SamplingParams(n=k, temperature=0.8, seed=args.seed + i, ignore_eos=True,
                                     max_tokens=min(s.expected_output_len, args.max_output_len))
                      for i, s in enumerate(samples)]
            llm.generate(prompts, params, use_tqdm=False)
            parallel = recorder.take_mean()
            out_len = min(int(np.mean([s.expected_output_len for s in samples])), args.max_output_len)
            llm.beam_search(prompts, BeamSearchParams(beam_width=k, max_tokens=max(1, out_len // 4), ignore_eos=True))
            beam = recorder.take_mean()
            llm.llm_engine.engine_core.reset_prefix_cache()
            rows.append({"dataset": name, "k": k, "parallel_saving": parallel, "beam_saving": beam})
            print(f"{name:9s} k={k}: parallel sampling {100 * parallel:5.1f}% (paper {PAPER[name]['parallel']}), "
                  f"beam search {100 * beam:5.1f}% (paper {PAPER[name]['beam']})", flush=True)
    if args.save_result:
        save_result(args.save_result, {"args": vars(args), "rows": rows, "paper": PAPER, "environment": environment_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
