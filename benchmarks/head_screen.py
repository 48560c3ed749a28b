"""The greedy head screen alone (csrc/cpu/variant/head_screen.cpp): int8 logits of a random float32 head, then the
exact recheck of every token that could be a row's maximum, at several row counts, on all threads.

The default shape is Llama-3.2-1B's head [128256, 2048] (its screen is 329 MB: the codes stream from memory at one
row and are re-read from L2 by each row block at 32), packed here in anonymous memory; the argmax is checked against
torch's float32 one. With `--model`, the screen an engine built for that model instead (on a second start, mapped
from the records cache), on random hidden states. Run it with `PAGEMILL_CPU_ISA=<variant>` for another kernel
variant. See docs/benchmarks/2026-11-29-head-screen-one-pass.md.

    python benchmarks/head_screen.py [--vocab 128256] [--hidden 2048] [--rows 1,4,32] [--reps 5] [--model PATH]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from pagemill.kernels.build import load_kernels


def _best_ms(fn: Callable[[], object], reps: int) -> float:
    """The best wall time of fn() in ms over `reps` calls after 2 warm-up calls."""
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def engine_screen(path: str, rows: list[int], reps: int) -> None:
    """Times the screen an engine built for the model at `path` (int8 preset) on random hidden states."""
    from pagemill import LLM

    llm = LLM(path, max_model_len=1024, linear_dtype="int8")
    screen = llm.llm_engine.engine_core.executor.model_runner.head_screen
    if screen is None:
        raise SystemExit(f"{path}: the engine built no head screen")
    print(f"{path}: screen {screen.nbytes / 1e6:.0f} MB, mapped from the records cache: {screen.mapped}")
    hidden = torch.randn(max(rows), screen.in_features, generator=torch.Generator().manual_seed(0))
    for m in rows:
        x = hidden[:m].contiguous()
        print(f"rows {m:3d}: {_best_ms(lambda: screen.logits(x), reps):7.2f} ms")


def main() -> None:
    """Times the screen per row count and prints ms, G multiply-adds per second and the rechecked logits."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rows", default="1,4,32", help="comma-separated row counts")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per row count (the best counts)")
    parser.add_argument("--model", help="time the screen an engine builds for this model instead")
    args = parser.parse_args()
    if args.model:
        engine_screen(args.model, [int(v) for v in args.rows.split(",")], args.reps)
        return
    kernels = load_kernels()
    g = torch.Generator().manual_seed(0)
    table = torch.randn(args.vocab, args.hidden, generator=g) * 0.02
    q, scales, offsets, bounds = kernels.pack_head_screen(table)
    mb = sum(t.numel() * t.element_size() for t in (q, scales, offsets, bounds)) / 1e6
    print(f"variant {kernels.isa()}, {torch.get_num_threads()} threads, head [{args.vocab}, {args.hidden}], "
          f"screen {mb:.0f} MB")
    for m in (int(v) for v in args.rows.split(",")):
        x = torch.randn(m, args.hidden, generator=g)
        logits, tokens = torch.empty(m, args.vocab), torch.empty(m, dtype=torch.int64)

        def screen() -> int:
            return kernels.head_screen(logits, x, q, scales, offsets, table, bounds, tokens, None, None,
                                       table_ggml_type=0)

        ms = _best_ms(screen, args.reps)
        rechecked = screen()
        exact = bool(torch.equal(tokens, (x @ table.T).argmax(dim=1)))
        print(f"rows {m:3d}: {ms:7.2f} ms  {m * args.vocab * args.hidden / ms / 1e6:6.1f} GMAC/s  "
              f"rechecked {rechecked / m:.0f} per row  argmax equals float32: {exact}")


if __name__ == "__main__":
    main()
