"""The greedy head screen in the engine: rows that need only the argmax take it (exact tokens), every other row
(logprobs, sampling, penalties, min_tokens) keeps the exact head, and a mixed batch gives what it gives without it."""

from __future__ import annotations

import pytest

from pagemill import LLM, SamplingParams
from tests.conftest import SMOL_PROMPTS, requires_kernels

pytestmark = requires_kernels


def mixed_requests() -> list[tuple[str, SamplingParams]]:
    """24 requests: plain greedy (screened) next to greedy with logprobs, seeded sampling, a repetition penalty and
    min_tokens (exact head)."""
    kinds = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=20, logprobs=2),
             SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20),
             SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=20),
             SamplingParams(temperature=0, min_tokens=12, max_tokens=20)]
    return [(SMOL_PROMPTS[i % len(SMOL_PROMPTS)], kinds[0] if i % 2 else kinds[(i // 2) % len(kinds)])
            for i in range(24)]


def run(llm: LLM) -> list[tuple[list[int], list | None]]:
    reqs = mixed_requests()
    outs = llm.generate([p for p, _ in reqs], [s for _, s in reqs], use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def screen_of(llm: LLM):
    return llm.llm_engine.engine_core.executor.model_runner.head_screen


@pytest.fixture(scope="module")
def exact_outputs(smol_path):
    llm = LLM(smol_path, kv_cache_memory="256MiB", max_model_len=1024, greedy_head_screen=False)
    assert screen_of(llm) is None
    return run(llm)


def test_mixed_batch_equals_exact_head(smol_llm, exact_outputs):
    screen = screen_of(smol_llm)
    assert screen is not None and screen.weight_error == 0.0  # SmolLM2's head is Q8_0: held exactly
    rows_before = screen.rows
    outputs = run(smol_llm)
    assert screen.rows > rows_before  # the plain greedy rows took the screen
    for (ids, lps), (ref_ids, ref_lps) in zip(outputs, exact_outputs):
        assert ids == ref_ids
        if ref_lps is not None:  # the exact head on fewer rows: another summation order, float32 noise apart
            for d, ref_d in zip(lps, ref_lps, strict=True):
                assert d.keys() == ref_d.keys()
                assert all(abs(d[t].logprob - ref_d[t].logprob) < 1e-3 for t in d)


def test_screen_recomputes_few_logits(smol_llm):
    """A handful of exact logits per screened row, not the vocabulary (49,152)."""
    screen = screen_of(smol_llm)
    rows, recomputed = screen.rows, screen.recomputed
    smol_llm.generate(SMOL_PROMPTS[:8], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert screen.rows - rows >= 8 * 15
    assert (screen.recomputed - recomputed) / (screen.rows - rows) < 200
