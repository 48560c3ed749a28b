"""allowed_token_ids, logit_bias and truncate_prompt_tokens (vLLM's SamplingParams fields) through the engine."""

from __future__ import annotations

import pytest

from pagemill import SamplingParams

PROMPT = "The capital of France is"


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 6), ignore_eos=True, **kw)


def test_allowed_token_ids_restrict_every_step_to_the_best_allowed(smol_llm, smol_hf) -> None:
    import torch

    model, tok = smol_hf
    allowed = tok.encode(" Paris London Rome yes no the a")
    out = smol_llm.generate(PROMPT, greedy(allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    with torch.inference_mode():
        logits = model(torch.tensor([tok.encode(PROMPT)])).logits[0, -1]
    assert out.token_ids[0] == allowed[int(logits[allowed].argmax())]


def test_logit_bias_pushes_and_forbids_tokens(smol_llm) -> None:
    free = smol_llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    forced = smol_llm.generate(PROMPT, greedy(logit_bias={"42": 100}), use_tqdm=False)[0].outputs[0].token_ids
    assert list(forced) == [42] * 6
    banned = smol_llm.generate(PROMPT, greedy(logit_bias={free[0]: -100}), use_tqdm=False)[0].outputs[0].token_ids
    assert banned[0] != free[0]
    mixed = smol_llm.generate([PROMPT, PROMPT], [greedy(logit_bias={42: 100}), greedy()], use_tqdm=False)
    assert list(mixed[0].outputs[0].token_ids) == [42] * 6 and mixed[1].outputs[0].token_ids == free


def test_truncate_prompt_tokens_keeps_the_prompts_end(smol_llm) -> None:
    tok = smol_llm.get_tokenizer()
    ids = tok.encode("Once upon a time there was a cat. " + PROMPT)
    out = smol_llm.generate({"prompt_token_ids": ids}, greedy(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-5:]
    alone = smol_llm.generate({"prompt_token_ids": ids[-5:]}, greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("kwargs, field", [
    (dict(allowed_token_ids=[10**7]), "allowed_token_ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(logit_bias={10**7: 1.0}), "logit_bias"),
    (dict(logit_bias={1: 101.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
])
def test_bad_values_name_the_field(smol_llm, kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        smol_llm.generate(PROMPT, greedy(**kwargs), use_tqdm=False)
