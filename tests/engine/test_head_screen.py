"""The greedy head screen in the engine: rows that need only the argmax take it (exact tokens; a constrained row's
argmax over its grammar's allowed tokens), every other row (logprobs, sampling, penalties, min_tokens) keeps the exact
head, and a mixed batch gives what it gives without it."""

from __future__ import annotations

import pytest

from pagemill import LLM, SamplingParams
from pagemill.sampling_params import StructuredOutputsParams
from tests.conftest import SMOL_PROMPTS, requires_kernels
from tests.structured_output.conftest import chat_prompt
from tests.structured_output.schemas import SCHEMAS

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
def exact_llm(smol_path):
    llm = LLM(smol_path, kv_cache_memory="256MiB", max_model_len=1024, greedy_head_screen=False)
    assert screen_of(llm) is None
    return llm


@pytest.fixture(scope="module")
def exact_outputs(exact_llm):
    return run(exact_llm)


def test_mixed_batch_equals_exact_head(smol_llm, exact_outputs):
    screen = screen_of(smol_llm)
    assert screen is not None and (screen.bounds[:, 0] == 0.0).all()  # SmolLM2's head is Q8_0: held exactly
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


def test_float_head_takes_the_screen_from_one_row(smol_path, smol_llm):
    """A float32 head streams four bytes per weight, so a lone greedy row takes the int8 screen (a quarter of the
    bytes); a head kept in Q8_0 records streams as many bytes as the screen, so 1-3 rows keep the exact head unless
    the screen was measured faster at one row. Greedy tokens equal the exact head's either way."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    float_llm = LLM(smol_path, kv_cache_memory="256MiB", max_model_len=1024, quantization="none")
    exact = LLM(smol_path, kv_cache_memory="256MiB", max_model_len=1024, quantization="none",
                greedy_head_screen=False)
    for llm, allowed in ((float_llm, (1,)), (smol_llm, (1, 4))):
        screen = screen_of(llm)
        min_rows = screen.min_rows
        assert min_rows in allowed
        rows = screen.rows
        out = llm.generate(SMOL_PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
        assert (screen.rows - rows > 0) == (min_rows == 1)  # one request decoding: one row per step
        if min_rows == 1:
            assert out == exact.generate(SMOL_PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids


def constrained_requests() -> list[tuple[str, SamplingParams]]:
    """Greedy requests under a JSON schema, a regex and a choice on both backends, next to plain greedy ones."""
    constraints = [dict(json=SCHEMAS[i][1]) for i in (0, 7, 41)] + [
        dict(regex=r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,10}"), dict(regex=r"\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}"),
        dict(choice=["positive", "negative", "neutral"])]
    prompts = [f"Give an example {SCHEMAS[i][0].replace('_', ' ')} as JSON." for i in (0, 7, 41)] + [
        "Name a person.", "Write a phone number.", "Sentiment of: I love it"]
    reqs = [(chat_prompt(p), SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(
        **c, _backend=backend))) for backend in ("xgrammar", "guidance") for p, c in zip(prompts, constraints)]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return reqs + [(SMOL_PROMPTS[i % len(SMOL_PROMPTS)], plain) for i in range(4)]


def test_constrained_greedy_rows_take_the_screen_with_their_masks(smol_llm, exact_llm):
    """Constrained greedy rows (JSON schema, regex, choice; xgrammar and llguidance) mixed with plain ones give the
    exact head's tokens, and they went through the screen (the plain rows alone are too few for it)."""
    reqs = constrained_requests()
    prompts, params = [p for p, _ in reqs], [s for _, s in reqs]
    ref = [o.outputs[0].token_ids for o in exact_llm.generate(prompts, params, use_tqdm=False)]
    screen = screen_of(smol_llm)
    rows = screen.rows
    outs = smol_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert screen.rows - rows >= 12 * 10  # the constrained rows too (the 4 plain ones give at most 4 * 24)
    rows = screen.rows
    constrained_only = smol_llm.generate(prompts[:12], params[:12], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in constrained_only] == ref[:12]
    assert screen.rows > rows


@pytest.mark.slow
def test_speculating_constrained_rows_take_the_screen(smol_path, exact_llm):
    """Jump-forward / n-gram drafts of constrained requests are verified through the screen with each position's
    mask: the tokens of the exact head without speculation."""
    reqs = constrained_requests()
    prompts, params = [p for p, _ in reqs], [s for _, s in reqs]
    ref = [o.outputs[0].token_ids for o in exact_llm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "max_batch_size": 1000,
                                  "min_acceptance_rate": 0.0})
    rows = screen_of(llm).rows
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    assert screen_of(llm).rows - rows >= 12 * 10
    assert llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding.num_accepted_tokens > 0


def test_one_row_choice_is_measured(smol_llm):
    """A quantized head takes the screen at one row exactly when the screen is measured clearly faster than the
    head's own records (here against a head made slow, then one made instant)."""
    import time
    from types import SimpleNamespace

    screen = screen_of(smol_llm)
    slow = SimpleNamespace(quant_method=SimpleNamespace(apply=lambda head, x: time.sleep(0.05)))
    instant = SimpleNamespace(quant_method=SimpleNamespace(apply=lambda head, x: None))
    rows, recomputed = screen.rows, screen.recomputed
    assert screen.one_row_is_faster(slow)
    assert not screen.one_row_is_faster(instant)
    screen.rows, screen.recomputed = rows, recomputed  # (the session-wide screen's statistics, as they were)
