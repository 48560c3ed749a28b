"""Speculation keeps the whole sampling pipeline at every verified position: penalties, min_tokens, logprobs, seeds,
structured output next to speculating requests; nothing is refused."""

from __future__ import annotations

import json

import pytest

from pagemill import LLM, SamplingParams
from pagemill.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

PROMPT = ("Repeat the list exactly.\nList: apples, pears, plums, apples, pears, plums, apples, pears, plums, apples, "
          "pears, plums.\nRepeated list: apples, pears,")
ALWAYS = {"max_batch_size": 1000, "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module")
def spec_llm(smol_path) -> LLM:
    return LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024,
               speculative_config={"method": "ngram", "num_speculative_tokens": 6, **ALWAYS})


def _drafts(llm: LLM) -> int:
    """Draft tokens verified so far."""
    return llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding.num_draft_tokens


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.05),
    dict(frequency_penalty=0.8, presence_penalty=0.5),
    dict(min_tokens=30, max_tokens=40),
], ids=["repetition", "frequency_presence", "min_tokens"])
def test_penalties_and_min_tokens_apply_at_every_draft_position(smol_llm, spec_llm, params):
    """Greedy with penalties: the penalty of position j counts the drafts before it, so outputs stay identical."""
    sp = SamplingParams(temperature=0, **{"max_tokens": 40, **params})
    ref = smol_llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    before = _drafts(spec_llm)
    out = spec_llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids
    assert _drafts(spec_llm) > before


def test_logprobs_are_the_target_models(smol_llm, spec_llm):
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    ref = smol_llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    out = spec_llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids
    assert len(out.logprobs) == len(ref.logprobs) == 30
    for a, b in zip(out.logprobs, ref.logprobs):
        assert set(a) == set(b)
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-3)
            assert a[t].rank == b[t].rank
    assert out.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-2)


def test_a_stop_token_inside_accepted_drafts_cuts_tokens_and_logprobs(smol_llm, spec_llm):
    """The outputs after a stop token that was accepted as a draft are dropped, with their logprobs."""
    free = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    stop = tokens[12]  # deep in the repeated list: drafted and accepted
    sp = SamplingParams(temperature=0, max_tokens=30, logprobs=2, stop_token_ids=[stop])
    out = spec_llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    want = list(tokens[:tokens.index(stop) + 1])
    assert list(out.token_ids) == want and len(out.logprobs) == len(want)
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_sampled_requests_every_parameter_and_seeds(smol_llm, spec_llm):
    """Temperature, top-k, top-p, min-p and penalties are all accepted with speculation; a seed reproduces, alone
    or in a batch, and gives the tokens it gives without speculation (however many drafts the back-off allowed)."""
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1, seed=7,
                        max_tokens=40, ignore_eos=True)
    before = _drafts(spec_llm)
    a = spec_llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].token_ids
    b = spec_llm.generate([PROMPT, "Once upon a time"], sp, use_tqdm=False)[0].outputs[0].token_ids
    plain = smol_llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b == plain and len(a) == 40
    assert len(set(a)) > 3  # sampled, and still the list (a drafting-friendly text)
    assert _drafts(spec_llm) > before  # drafts were verified for sampled requests too


def test_structured_output_next_to_speculating_requests(smol_llm, spec_llm):
    """A JSON-constrained request (no drafts) in the same steps as speculating ones: each gets what it would alone."""
    schema = {"type": "object", "properties": {"fruit": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["fruit", "count"], "additionalProperties": False}
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=60,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    ref = smol_llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    outs = spec_llm.generate([PROMPT, "Give a fruit and a count as JSON:", PROMPT], [greedy, constrained, greedy],
                             use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref == outs[2].outputs[0].token_ids
    data = json.loads(outs[1].outputs[0].text)
    assert set(data) == {"fruit", "count"}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_constrained_requests_speculate_too(smol_path, backend):
    """Drafts of a constrained request are checked by its grammar and verified under its per-position masks: the
    output equals the constrained output without speculation, and drafts were accepted."""
    regex = r" plums(, (apples|pears|plums)){4,12}\."
    sp = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(regex=regex))
    llm = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024, structured_outputs_backend=backend,
              speculative_config={"method": "ngram", "num_speculative_tokens": 5, **ALWAYS})
    plain = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024, structured_outputs_backend=backend)
    ref = plain.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    outs = llm.generate([PROMPT, PROMPT + " plums"], [sp, SamplingParams(temperature=0, max_tokens=30)],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref.token_ids
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].text.endswith(".")
    spec = llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding
    assert spec.num_accepted_tokens > 10


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_jump_forward_drafts_the_tokens_a_grammar_forces(smol_path, backend):
    """JSON keys and punctuation the schema forces are drafted (and always accepted) even with nothing for the
    n-gram proposer to match: the same output as without speculation, in fewer steps."""
    schema = {"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 12},
                                               "year_of_birth": {"type": "integer"},
                                               "favourite_colour": {"enum": ["red", "green", "blue"]}},
              "required": ["first_name", "year_of_birth", "favourite_colour"], "additionalProperties": False}
    sp = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema))
    prompt = "Describe a person as JSON:"
    plain = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024, structured_outputs_backend=backend)
    ref = plain.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    llm = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024, structured_outputs_backend=backend,
              speculative_config={"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 8,
                                                  "prompt_lookup_max": 8})
    out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids
    assert set(json.loads(out.text)) == set(schema["properties"])
    spec = llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding
    assert spec.num_accepted_tokens >= 8  # the forced keys at least


def test_per_request_opt_out(spec_llm):
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, speculative_decoding=False)
    before = spec_llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding.num_drafts
    spec_llm.generate(PROMPT, sp, use_tqdm=False)
    assert spec_llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding.num_drafts == before


def test_bad_speculative_config_names_the_field(smol_path):
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(smol_path, speculative_config={"method": "medusa"})
    with pytest.raises(ValueError, match="unknown keys"):
        LLM(smol_path, speculative_config={"method": "ngram", "num_spec_tokens": 3})
    with pytest.raises(ValueError, match="draft_num_layers"):
        LLM(smol_path, speculative_config={"method": "draft_model"})
