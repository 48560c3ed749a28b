"""Pipeline parallelism with and without micro-batching: PP=2 (one thread per stage) keeping two batches in flight
(the default) vs one batch at a time (the engine core's batch queue switched off, as before), and one process with
the same threads. Output tok/s of a batch of greedy requests, the prefill included.

    python benchmarks/pp_microbatch.py --batch-sizes 1,8,32 --save-result results/pp_microbatch.json

The model is a random float32 Llama built by transformers (benchmarks/tp_scaling.py's shape by default).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

from pagemill import LLM
from pagemill.benchmarks.report import environment_info, save_result

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tp_scaling import add_model_args, build_model, decode_rate  # noqa: E402


def set_micro_batching(llm: LLM, on: bool) -> None:
    """Switch the engine core's batch queue (pipeline micro-batches) on or off between runs."""
    from collections import deque

    core = llm.llm_engine.engine_core
    core.batch_queue = deque() if on else None
    core.scheduler.max_concurrent_batches = core.batch_queue_size if on else 1


def main(argv: list[str] | None = None) -> int:
    """Measure PP=2 with and without micro-batches, and PP=1, side by side."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, "1,8,32", "cores: PP=1 uses them as threads, PP=2 one per stage")
    ap.add_argument("--save-result", default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows: dict[str, Any] = {}
    engine = dict(kv_cache_memory="256MiB", max_model_len=1024)
    with tempfile.TemporaryDirectory() as root:
        path = build_model(root, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab)
        llm = LLM(path, pipeline_parallel_size=2, num_threads=max(1, args.threads // 2), **engine)
        executor = llm.llm_engine.engine_core.executor
        for on in (True, False):
            set_micro_batching(llm, on)
            for b in batches:
                executor.steps.max_in_flight = 0
                tok_s, seconds = decode_rate(llm, b, args.input_len, args.output_len, 1)
                key = f"pp2_{'micro' if on else 'single'}_batch{b}"
                rows[key] = {"tok_s": round(tok_s, 1), "seconds": round(seconds, 3),
                             "max_in_flight": executor.steps.max_in_flight}
                print(key, rows[key], flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
        llm = LLM(path, num_threads=args.threads, **engine)
        for b in batches:
            tok_s, seconds = decode_rate(llm, b, args.input_len, args.output_len, 1)
            rows[f"pp1_batch{b}"] = {"tok_s": round(tok_s, 1), "seconds": round(seconds, 3)}
            print(f"pp1_batch{b}", rows[f"pp1_batch{b}"], flush=True)
    result = {"args": vars(args), "rows": rows, "env": environment_info()}
    if args.save_result:
        save_result(args.save_result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
