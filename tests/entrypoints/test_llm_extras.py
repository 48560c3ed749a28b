"""vLLM's offline-API details: `llm.model_config` with vLLM's field names, `priority` as one int (generate) and in
chat, `LLM(skip_tokenizer_init=True)` with token-id prompts, `logprobs=-1` / `prompt_logprobs=-1` (the whole
vocabulary, bounded by max_logprobs), errors that name every bad value, and over-long prompts."""

from __future__ import annotations

import pytest
import torch

from pagemill import LLM, SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, kv_cache_memory="64MiB", max_logprobs=-1, scheduling_policy="priority")


def test_model_config_has_vllm_names(llm):
    mc = llm.model_config
    assert mc.max_model_len == 256 and mc.dtype == torch.float32 and mc.runner_type == "generate"
    assert mc.model.endswith(".gguf") and mc.tokenizer and mc.seed == 0 and mc.max_logprobs == -1
    assert mc.skip_tokenizer_init is False and mc.get_vocab_size() == 49152 and mc.get_hidden_size() == 576
    assert mc.architecture and mc.architectures == [mc.architecture]
    assert mc.get_num_layers() == 30 and mc.get_head_size() == 64
    assert llm.llm_engine.config.model_config is mc


def test_priority_as_one_int_and_in_chat(llm):
    params = SamplingParams(max_tokens=4, temperature=0)
    base = llm.generate([PROMPT, "Hello"], params, use_tqdm=False)
    ranked = llm.generate([PROMPT, "Hello"], params, use_tqdm=False, priority=3)
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in base]
    messages = [{"role": "user", "content": "Say hi."}]
    chat = llm.chat(messages, params, use_tqdm=False, priority=-2)
    assert chat[0].outputs[0].token_ids == llm.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate([PROMPT, "Hello"], params, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="^priority must be an integer"):
        llm.generate(PROMPT, params, use_tqdm=False, priority="high")


def test_logprobs_minus_one_is_the_whole_vocabulary(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, logprobs=-1, prompt_logprobs=-1),
                       use_tqdm=False)[0]
    assert [len(p) for p in out.outputs[0].logprobs] == [49152, 49152]
    assert out.prompt_logprobs[0] is None and all(len(p) == 49152 for p in out.prompt_logprobs[1:])
    top = max(out.outputs[0].logprobs[0].values(), key=lambda lp: lp.logprob)
    assert top.rank == 1 and abs(sum(torch.tensor([lp.logprob for lp in out.outputs[0].logprobs[0].values()])
                                     .exp().tolist()) - 1) < 1e-3


def test_errors_name_every_bad_value(llm):
    with pytest.raises(ValueError, match="^logit_bias must be token ids in \\[0, 49152\\), got out-of-vocabulary "
                                         "keys 49152, 100000"):
        llm.generate(PROMPT, SamplingParams(max_tokens=1, logit_bias={1: 1.0, 49152: 2.0, 100000: 3.0}),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="^logit_bias keys must be non-negative token ids, got 'a', '-3'"):
        SamplingParams(logit_bias={"a": 1, "-3": 1, "7": 1})
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        llm.generate({"prompt_token_ids": [1] * 300}, SamplingParams(max_tokens=1), use_tqdm=False)


def test_logprobs_minus_one_bounded_by_max_logprobs():
    small = LLM(max_model_len=128, kv_cache_memory="32MiB", skip_tokenizer_init=True)
    ids = [504, 3575, 282, 4649, 314]
    with pytest.raises(ValueError, match="^logprobs=-1 asks for the whole vocabulary \\(49152 tokens\\), more than "
                                         "max_logprobs \\(20\\)"):
        small.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)
    # skip_tokenizer_init: token ids in, token ids out, no text
    out = small.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=5, temperature=0, logprobs=1),
                         use_tqdm=False)[0]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 5
    assert all(lp.decoded_token is None for lp in out.outputs[0].logprobs[0].values())
    assert small.model_config.skip_tokenizer_init is True
    with pytest.raises(ValueError, match="^prompt: the engine runs with skip_tokenizer_init"):
        small.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="^stop: the engine runs with skip_tokenizer_init"):
        small.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, stop=["."]), use_tqdm=False)


def test_stop_token_not_in_text_with_special_tokens_kept(llm):
    """As vLLM: the EOS / stop token that ends a reply is not detokenized, even with skip_special_tokens=False."""
    messages = [{"role": "user", "content": "Say hi."}]
    kept = llm.chat(messages, SamplingParams(max_tokens=60, temperature=0, skip_special_tokens=False),
                    use_tqdm=False)[0].outputs[0]
    plain = llm.chat(messages, SamplingParams(max_tokens=60, temperature=0), use_tqdm=False)[0].outputs[0]
    assert kept.finish_reason == "stop" and kept.token_ids == plain.token_ids
    assert kept.text == plain.text and "<|im_end|>" not in kept.text
    shown = llm.chat(messages, SamplingParams(max_tokens=60, temperature=0, skip_special_tokens=False,
                                              include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert shown.text == plain.text + "<|im_end|>"
