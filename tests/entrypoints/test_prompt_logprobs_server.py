"""Prompt logprobs end to end (issue 22): OpenAI `echo` with `logprobs` and `max_tokens=0` (what lm-eval's
loglikelihood tasks send) equals HF transformers' log-softmax, `prompt_logprobs` in both endpoints, streamed
completion logprobs chunk by chunk, and prompt logprobs under chunked prefill and prefix-cache hits."""

from __future__ import annotations

import json

import pytest
import torch

from tests.entrypoints.conftest import MODEL

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The quick brown fox jumps over the lazy dog because it"


@pytest.fixture(scope="module")
def prompt_ids(http) -> list[int]:
    return http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]


@pytest.fixture(scope="module")
def hf_logprobs(smol_hf, prompt_ids) -> torch.Tensor:
    """HF's float32 log-softmax at every prompt position (row i predicts token i + 1)."""
    model, _ = smol_hf
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    return logits.log_softmax(-1)


def test_echo_with_max_tokens_0_scores_the_prompt_like_hf(http, prompt_ids, hf_logprobs):
    r = http.post(COMPLETIONS, json={"model": MODEL, "prompt": prompt_ids, "max_tokens": 0, "echo": True,
                                     "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt_ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [hf_logprobs[i, prompt_ids[i + 1]].item() for i in range(len(prompt_ids) - 1)]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    for i, top in enumerate(lp["top_logprobs"][1:]):  # the top-1 candidate is HF's argmax
        best = hf_logprobs[i].max().item()
        assert max(top.values()) == pytest.approx(best, abs=1e-4)
    assert choice["text"] == "".join(lp["tokens"]) == http.post(
        "/detokenize", json={"tokens": prompt_ids}).json()["prompt"]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(prompt_ids)


def test_echo_with_generation_appends_the_output(http, prompt_ids):
    r = http.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 2,
                                     "temperature": 0, "ignore_eos": True})
    choice = r.json()["choices"][0]
    plain = http.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                         "ignore_eos": True}).json()["choices"][0]["text"]
    assert choice["text"] == PROMPT + plain
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt_ids) + 3
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert all(len(t) <= 3 for t in lp["top_logprobs"][1:])


def test_prompt_logprobs_field_in_both_endpoints(http, prompt_ids, hf_logprobs):
    r = http.post(COMPLETIONS, json={"prompt": prompt_ids, "max_tokens": 1, "prompt_logprobs": 2})
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt_ids)
    for i, pos in enumerate(plp[1:]):
        entry = pos[str(prompt_ids[i + 1])]
        assert entry["logprob"] == pytest.approx(hf_logprobs[i, prompt_ids[i + 1]].item(), abs=1e-4)
        ranks = sorted(v["rank"] for t, v in pos.items() if t != str(prompt_ids[i + 1]) or v["rank"] <= 2)
        assert ranks[:2] == [1, 2]
    chat = http.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                 "prompt_logprobs": 0, "return_token_ids": True}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"])
    assert all(len(p) == 1 for p in chat["prompt_logprobs"][1:])  # the prompt token only


def test_streamed_completion_logprobs_arrive_chunk_by_chunk(http):
    body = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 2, "temperature": 0, "ignore_eos": True}
    full = http.post(COMPLETIONS, json=body).json()["choices"][0]
    with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    tokens, token_lps, tops, offsets = [], [], [], []
    for e in events:
        lp = e["choices"][0]["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, lp  # never {}
        assert len(lp["tokens"]) >= 1
        tokens += lp["tokens"]
        token_lps += lp["token_logprobs"]
        tops += lp["top_logprobs"]
        offsets += lp["text_offset"]
    assert tokens == full["logprobs"]["tokens"] and "".join(tokens) == full["text"]
    assert token_lps == pytest.approx(full["logprobs"]["token_logprobs"], abs=1e-5)
    assert offsets == full["logprobs"]["text_offset"]
    assert [sorted(t) for t in tops] == [sorted(t) for t in full["logprobs"]["top_logprobs"]]


def test_prompt_logprobs_with_chunked_prefill_and_prefix_hits_equal_a_cold_pass(smol_path):
    from pagemill import LLM, SamplingParams

    prompt = {"prompt_token_ids": list(range(300, 420))}  # 120 tokens: 4 chunks of 32
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    cold = LLM(smol_path, kv_cache_memory="64MiB", max_model_len=512, enable_prefix_caching=False)
    reference = cold.generate([prompt], params, use_tqdm=False)[0]
    del cold
    llm = LLM(smol_path, kv_cache_memory="64MiB", max_model_len=512, max_num_batched_tokens=32,
              enable_prefix_caching=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # caches the prefix
    got = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(got.prompt_logprobs) == len(reference.prompt_logprobs) == 120 and got.prompt_logprobs[0] is None
    for a, b in zip(got.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
            if b[t].rank <= 3:  # a deep prompt token's rank can move by a near-tie in float noise
                assert a[t].rank == b[t].rank
    assert got.outputs[0].token_ids == reference.outputs[0].token_ids
