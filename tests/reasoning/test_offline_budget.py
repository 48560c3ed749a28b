"""The offline LLM with reasoning_parser (an EngineArgs field, as vLLM's): thinking_token_budget forces `</think>`
after the budget, and the structured-output grammar applies after it; without a parser the budget is refused."""

from __future__ import annotations

import pytest

from pagemill import LLM, SamplingParams
from pagemill.sampling_params import StructuredOutputsParams

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(reasoning_parser="deepseek_r1", kv_cache_memory="64MiB", max_model_len=512, max_num_seqs=4)


def test_budget_forces_the_end_marker_then_the_grammar(llm):
    end = llm.get_tokenizer().encode("</think>", add_special_tokens=False)
    sp = SamplingParams(temperature=0, max_tokens=30, thinking_token_budget=3,
                        structured_outputs=StructuredOutputsParams(choice=["Paris", "London"]))
    out = llm.chat(CHAT, sp)[0].outputs[0]
    assert list(out.token_ids[3:3 + len(end)]) == end
    thinking, _, answer = out.text.partition("</think>")
    assert thinking and answer in ("Paris", "London") and out.finish_reason == "stop"
    zero = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10, thinking_token_budget=0))[0].outputs[0]
    assert list(zero.token_ids[:len(end)]) == end


def test_reasoning_parser_is_checked():
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        LLM(reasoning_parser="nope", kv_cache_memory="64MiB", max_model_len=512)
