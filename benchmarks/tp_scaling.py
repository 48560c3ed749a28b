"""Tensor parallelism on one host: TP=2 (one thread per rank) vs TP=1 (the same cores as threads), decode tok/s and
the share of a step the ranks spend in all-reduce / all-gather (timed inside the worker processes); each TP=2 engine
with the shared-memory collectives and with gloo only (`--collectives`).

    python benchmarks/tp_scaling.py --save-result results/tp_scaling.json

The model is a random float32 Llama built by transformers (SmolLM2's 9 heads do not split over 2 ranks).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import torch

from pagemill import LLM, SamplingParams
from pagemill.benchmarks.report import environment_info, save_result
from pagemill.distributed.shm_communicator import ENABLE_ENV as SHM_ENV

_COLLECTIVE_SECONDS = [0.0]


def install_collective_timer(model: Any) -> int:
    """In a worker: time every tensor-parallel all_reduce / all_gather (shared memory or gloo) from now on (runs via
    apply_model)."""
    from pagemill.distributed.group_coordinator import GroupCoordinator

    for name in ("all_reduce", "all_gather"):
        original = getattr(GroupCoordinator, name)
        if getattr(original, "_timed", False):
            continue

        def timed(*args: Any, _original=original, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                _COLLECTIVE_SECONDS[0] += time.perf_counter() - start

        timed._timed = True
        setattr(GroupCoordinator, name, timed)
    _COLLECTIVE_SECONDS[0] = 0.0
    return 0


def read_collective_timer(model: Any) -> float:
    """In a worker: seconds spent in collectives since the timer was installed or last read."""
    seconds, _COLLECTIVE_SECONDS[0] = _COLLECTIVE_SECONDS[0], 0.0
    return seconds


def build_model(root: str, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int) -> str:
    """A random Llama saved as a HF directory (SmolLM2's tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagemill.benchmarks.model_path import load_hf_tokenizer
    from pagemill.loader.default_model import default_model_path

    tokenizer = load_hf_tokenizer(default_model_path())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=max(vocab, len(tokenizer)), hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def add_model_args(ap: argparse.ArgumentParser, batch_sizes: str, threads_help: str) -> None:
    """The random Llama's shape and the run's sizes (shared with benchmarks/pp_microbatch.py)."""
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batch-sizes", default=batch_sizes)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help=threads_help)


def decode_rate(llm: LLM, batch: int, input_len: int, output_len: int, tp: int) -> tuple[float, float]:
    """(decode tok/s, seconds) of `batch` requests generating `output_len` tokens after a warm-up (which the
    collective timers of a TP engine do not count)."""
    prompts = [{"prompt_token_ids": [100 + (i * 7 + j) % 3000 for j in range(input_len)]} for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    if tp > 1:
        llm.apply_model(read_collective_timer)
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # the prefill step first (not timed as decode), then the decode steps
    start = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - start
    return batch * output_len / seconds, seconds


def main(argv: list[str] | None = None) -> int:
    """Measure TP=1 (2 threads) and TP=2 (1 thread per rank) side by side."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, "1,8", "cores: TP=1 uses them as threads, TP=2 one per rank")
    ap.add_argument("--tp-sizes", default="1,2,1", help="engines to run, in order (1 again: the noise)")
    ap.add_argument("--collectives", default="shm,gloo",
                    help="each TP=2 engine once per entry: shm (shared memory where it fits) or gloo only")
    ap.add_argument("--save-result", default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if not set(args.collectives.split(",")) <= {"shm", "gloo"}:
        ap.error(f"--collectives: a comma-separated list of shm and gloo, got {args.collectives!r}")
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as root:
        path = build_model(root, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab)
        runs = [(int(t), mode) for t in args.tp_sizes.split(",")
                for mode in (args.collectives.split(",") if int(t) > 1 else [""])]
        for run, (tp, mode) in enumerate(runs):
            engine = dict(kv_cache_memory="256MiB", max_model_len=1024)
            if tp == 1:
                llm = LLM(path, num_threads=args.threads, **engine)
            else:
                os.environ[SHM_ENV] = "0" if mode == "gloo" else "1"  # read by the worker processes
                llm = LLM(path, tensor_parallel_size=2, num_threads=args.threads // 2, **engine)
                llm.apply_model(install_collective_timer)
            for b in batches:
                rate, seconds = decode_rate(llm, b, args.input_len, args.output_len, tp)
                row = {"tok_s": round(rate, 1), "seconds": round(seconds, 3)}
                if tp == 2:
                    per_rank = llm.apply_model(read_collective_timer)
                    row["collective_s_per_rank"] = [round(s, 3) for s in per_rank]
                    row["collective_share"] = [round(s / seconds, 3) for s in per_rank]
                rows[f"run{run}_tp{tp}{'_' + mode if mode else ''}_batch{b}"] = row
                print(f"TP={tp} {mode} batch {b}: {rate:.1f} tok/s ({seconds:.2f} s)", row, flush=True)
            if tp == 2:
                llm.llm_engine.engine_core.shutdown()
            del llm
    result = {"args": vars(args), "rows": rows, "env": environment_info()}
    if args.save_result:
        save_result(args.save_result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
