"""One-row float kernels: the byte-permute unpack against the split-unit form (Zen 4), A/B in one process.

Kernel level: `gemv_records` at one row over random GGUF blocks of a format, in cache on one thread and streamed
(several layers) on all threads. Engine level (`--model`): single-stream greedy decode after a cached prompt,
alternating the two forms. The forms compute the same bits (tests/kernels/test_gguf_records.py); only the time
differs. See docs/benchmarks/2026-11-29-zen4-split-unpack.md.

    python benchmarks/split_unpack.py [--formats q4_k,q6_k] [--model PATH.gguf] [--tokens 100] [--reps 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

import torch

from pagemill.kernels.build import load_kernels
from pagemill.layers.quantization.gguf import pack_records
from pagemill.layers.quantization.gguf_records import PLANE_LAYOUTS

K = 2048


def _mean_ms(fn: Callable[[], None], n: int) -> float:
    """Mean wall time of fn() in ms over n calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def kernel_ab(kernels, fmt: str, n_out: int, layers: int, threads: int, calls: int, reps: int) -> None:
    """G weights/s of each form at one row over `layers` [n_out, K] matrices of `fmt`."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the tests' GGUF block maker
    from tests.kernels.gguf_blocks import make_blocks

    torch.set_num_threads(threads)
    packed = [pack_records([(fmt, make_blocks(fmt, n_out, K, seed=i))]) for i in range(layers)]
    x, out = torch.randn(1, K), torch.empty(1, n_out)

    def run() -> None:
        for kind, records in packed:
            kernels.gemv_records(out, x, records, PLANE_LAYOUTS[kind][3], None)

    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps):
        for split in (False, True):
            kernels.set_split_zmm_units(split)
            rates[split].append(layers * n_out * K / _mean_ms(run, calls) / 1e6)
    print(f"{fmt} {layers} x [{n_out}, {K}] on {threads} thread(s), G weights/s: "
          + "; ".join(f"{'split' if s else 'permute'} " + " ".join(f"{r:.1f}" for r in v) for s, v in rates.items()))


def engine_ab(kernels, model: str, tokens: int, reps: int) -> None:
    """Single-stream greedy decode ms/token of each form (the prompt is cached after the warm-up)."""
    from pagemill import LLM, SamplingParams

    llm = LLM(model, max_model_len=2048)
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    ms: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps):
        for split in (False, True):
            kernels.set_split_zmm_units(split)
            t0 = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            ms[split].append((time.perf_counter() - t0) / tokens * 1e3)
    print("decode ms/token: " + "; ".join(f"{'split' if s else 'permute'} " + " ".join(f"{v:.2f}" for v in vals)
                                          for s, vals in ms.items()))


def main() -> None:
    """Run the kernel A/B for each format, then the engine A/B when a model is given."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="q4_k,q6_k")
    parser.add_argument("--model", help="a GGUF for the engine-level A/B")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    kernels = load_kernels()
    detected = kernels.split_zmm_units()
    print(f"variant {kernels.isa()}, split_zmm_units detected: {detected}")
    threads = torch.get_num_threads()
    try:
        for fmt in args.formats.split(","):
            kernel_ab(kernels, fmt, 1024, 1, 1, 3000, args.reps)
            kernel_ab(kernels, fmt, 16384, 8, threads, 20, args.reps)
        if args.model:
            torch.set_num_threads(threads)
            engine_ab(kernels, args.model, args.tokens, args.reps)
    finally:
        kernels.set_split_zmm_units(detected)


if __name__ == "__main__":
    main()
