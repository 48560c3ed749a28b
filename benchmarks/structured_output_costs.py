"""The two per-step costs of constrained greedy decoding at batch 32 (issue 12), measured apart from the forward:

1. the LM head of 32 json-constrained rows: the exact float32 head + our bitmask kernel + argmax, against the greedy
   head screen reading the bitmask (the tokens are checked equal on every recorded step);
2. the grammar mask fill, xgrammar's batch matcher against llguidance's parallel executor, replayed along the same
   greedy outputs (every token accepted by both grammars).

The request set is `bench throughput --structured-output json`'s. Each timing is the minimum of --repeats runs.

    python benchmarks/structured_output_costs.py [--model PATH] [--steps 40] [--repeats 7]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any, Callable

import torch

from pagemill import LLM, SamplingParams
from pagemill.benchmarks.structured_output import DATASET
from pagemill.loader.default_model import default_model_path
from pagemill.sample.bitmask import apply_token_bitmask
from pagemill.sampling_params import StructuredOutputsParams
from pagemill.structured_output.spec import prepare

ROWS = 32


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of `repeats` calls, seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def record_steps(llm: LLM, steps: int) -> tuple[list[list[int]], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Greedy outputs of the 32 json requests, and the (hidden, bitmask, mask rows) of the screen's first `steps`
    calls over all 32 rows."""
    screen = llm.llm_engine.engine_core.executor.model_runner.head_screen
    recorded, logits = [], screen.logits

    def recording(hidden, bitmask=None, mask_rows=None):
        if bitmask is not None and hidden.shape[0] == ROWS and len(recorded) < steps:
            recorded.append((hidden.clone(), bitmask.clone(), mask_rows.clone()))
        return logits(hidden, bitmask, mask_rows)

    screen.logits = recording
    try:
        items = [DATASET["json"][k % len(DATASET["json"])] for k in range(ROWS)]
        prompts = [{"prompt_token_ids": llm.render_chat([{"role": "user", "content": t}])} for t, _ in items]
        params = [SamplingParams(temperature=0, max_tokens=128, structured_outputs=StructuredOutputsParams(**c))
                  for _, c in items]
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        screen.logits = logits
    return outs, recorded


def head_costs(llm: LLM, recorded: list, repeats: int) -> dict[str, float]:
    """ms per step: exact head + mask + argmax vs the masked screen (tokens checked equal)."""
    runner = llm.llm_engine.engine_core.executor.model_runner
    screen, ops = runner.head_screen, runner.ops

    def exact(hidden, bitmask):
        logits = runner.model.compute_logits(hidden).float().contiguous()
        apply_token_bitmask(logits, bitmask, torch.arange(ROWS), ops)
        return logits.max(-1).indices

    exact_s, screen_s = [], []
    for hidden, bitmask, mask_rows in recorded:
        per_row = bitmask[mask_rows].contiguous()
        assert torch.equal(exact(hidden, per_row), screen.logits(hidden, bitmask, mask_rows)[1])
        exact_s.append(best_of(lambda: exact(hidden, per_row), repeats))
        screen_s.append(best_of(lambda: screen.logits(hidden, bitmask, mask_rows), repeats))
    return {"exact_head_mask_argmax_ms": 1e3 * statistics.mean(exact_s),
            "screen_masked_ms": 1e3 * statistics.mean(screen_s)}


def fill_costs(llm: LLM, outs: list[list[int]]) -> dict[str, dict[str, float]]:
    """Per backend: mean / median / max ms per step of the batch fill, and µs per row, along `outs`."""
    manager = llm.llm_engine.engine_core.structured_output_manager
    config = llm.llm_engine.config.structured_outputs_config
    items = [DATASET["json"][k % len(DATASET["json"])] for k in range(ROWS)]
    bitmask = torch.full((ROWS, (manager.vocab_size + 31) // 32), -1, dtype=torch.int32)
    result = {}
    for name in ("xgrammar", "guidance"):
        backend, compiled, grammars = manager.backend(name), {}, []
        for _, c in items:
            spec, _ = prepare(StructuredOutputsParams(**c, _backend=name), config)
            if spec not in compiled:
                compiled[spec] = backend.compile(spec)
            grammars.append(backend.new_grammar(compiled[spec]))
        times, rows = [], 0
        for step in range(max(len(o) for o in outs)):
            live = [j for j in range(ROWS) if step < len(outs[j]) and not grammars[j].is_terminated()]
            if not live:
                break
            start = time.perf_counter()
            backend.fill_bitmask([grammars[j] for j in live], bitmask, live)
            times.append(time.perf_counter() - start)
            rows += len(live)
            for j in live:
                assert grammars[j].accept_token(outs[j][step]), (name, j, step)
        result[name] = {"steps": len(times), "mean_ms": 1e3 * statistics.mean(times),
                        "median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times),
                        "us_per_row": 1e6 * sum(times) / rows}
    return result


def cpu_name() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=40, help="decode steps whose head is timed")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    llm = LLM(args.model or default_model_path(), kv_cache_memory="256MiB", max_model_len=1024)
    if llm.llm_engine.engine_core.executor.model_runner.head_screen is None:
        raise SystemExit("this model / build has no greedy head screen (kernels not built?)")
    print(f"{cpu_name()}, {torch.get_num_threads()} threads")
    outs, recorded = record_steps(llm, args.steps)
    head = head_costs(llm, recorded, args.repeats)
    print(f"LM head, {ROWS} json-constrained rows, {len(recorded)} steps: exact head + mask + argmax "
          f"{head['exact_head_mask_argmax_ms']:.2f} ms, screen with masks {head['screen_masked_ms']:.2f} ms "
          f"(same tokens)")
    for name, r in fill_costs(llm, outs).items():
        print(f"mask fill, {name}: {r['mean_ms']:.2f} ms per step mean, median {r['median_ms']:.2f}, max "
              f"{r['max_ms']:.2f} ({r['steps']} steps), {r['us_per_row']:.0f} µs per row")


if __name__ == "__main__":
    main()
