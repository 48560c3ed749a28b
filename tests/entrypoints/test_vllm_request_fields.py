"""vLLM's extra request fields and lenient parsing against a real server: unknown fields ignored with a warning,
any message role and extra message keys, logit_bias / allowed_token_ids, truncation, token ids in responses,
cached_tokens, beam search, continuous usage stats (issue 22)."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.conftest import MODEL

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Name a colour."}]


def sse_events(http, path: str, body: dict) -> list[dict]:
    """The JSON payloads of a streamed response."""
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_unknown_fields_are_ignored_with_a_header(http):
    base = {"model": MODEL, "messages": HI, "max_tokens": 5, "temperature": 0}
    plain = http.post(CHAT, json=base)
    r = http.post(CHAT, json={**base, "temprature": 0.5, "reasoning_effort_x": "high",
                              "stream_options_x": {"a": 1}})
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"].split(",") == ["temprature", "reasoning_effort_x", "stream_options_x"]
    assert "x-ignored-fields" not in plain.headers
    assert r.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    r = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2, "max_tokenz": 3})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "max_tokenz"


def _rendered(http, messages: list[dict], template: str) -> str:
    r = http.post("/tokenize", json={"messages": messages, "chat_template": template, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    d = http.post("/detokenize", json={"tokens": r.json()["tokens"]})
    return d.json()["prompt"]


def test_developer_and_custom_roles_and_extra_message_keys_reach_the_template(http):
    template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ m.get('weather', '-') }}]{% endfor %}"
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "ipython", "content": "42"},
                {"role": "user", "content": "Hi", "weather": "sunny"}]
    assert _rendered(http, messages, template) == "[developer|Be brief.|-][ipython|42|-][user|Hi|sunny]"
    r = http.post(CHAT, json={"messages": messages, "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_allowed_token_ids_and_logit_bias_steer_sampling(http, server):
    tok = http.post("/tokenize", json={"prompt": " blue green", "add_special_tokens": False}).json()["tokens"]
    r = http.post(CHAT, json={"messages": HI, "max_tokens": 4, "temperature": 0, "allowed_token_ids": tok,
                              "return_token_ids": True})
    ids = r.json()["choices"][0]["token_ids"]
    assert len(ids) == 4 and set(ids) <= set(tok)
    r = http.post(CHAT, json={"messages": HI, "max_tokens": 3, "temperature": 0, "return_token_ids": True,
                              "logit_bias": {str(tok[0]): 100}})
    assert r.json()["choices"][0]["token_ids"] == [tok[0]] * 3


def test_truncate_prompt_tokens_keeps_the_chosen_side(http):
    prompt = http.post("/tokenize", json={"prompt": "one two three four five six seven eight",
                                          "add_special_tokens": False}).json()["tokens"]
    for side, kept in (("left", prompt[-3:]), ("right", prompt[:3])):
        r = http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 3,
                                         "truncation_side": side, "return_token_ids": True, "echo": True})
        choice = r.json()["choices"][0]
        assert choice["prompt_token_ids"] == kept and r.json()["usage"]["prompt_tokens"] == 3
    r = http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": -1,
                                     "return_token_ids": True})
    assert r.json()["choices"][0]["prompt_token_ids"] == prompt


def test_return_token_ids_match_the_text(http):
    r = http.post(CHAT, json={"messages": HI, "max_tokens": 6, "temperature": 0, "return_token_ids": True})
    body = r.json()
    text = http.post("/detokenize", json={"tokens": body["choices"][0]["token_ids"]}).json()["prompt"]
    assert text == body["choices"][0]["message"]["content"]
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    events = sse_events(http, CHAT, {"messages": HI, "max_tokens": 6, "temperature": 0, "return_token_ids": True})
    assert events[0]["prompt_token_ids"] == body["prompt_token_ids"]
    streamed = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
    assert streamed == body["choices"][0]["token_ids"]


def test_tokens_as_token_ids_in_logprobs(http):
    r = http.post(CHAT, json={"messages": HI, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2,
                              "return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = r.json()["choices"][0]
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(t["token"].startswith("token_id:") for c in choice["logprobs"]["content"] for t in c["top_logprobs"])


def test_cached_tokens_count_prefix_cache_hits(http):
    messages = [{"role": "system", "content": "You are a careful assistant. " * 20}] + HI
    first = http.post(CHAT, json={"messages": messages, "max_tokens": 2}).json()["usage"]
    second = http.post(CHAT, json={"messages": messages, "max_tokens": 2}).json()["usage"]
    assert second["prompt_tokens_details"]["cached_tokens"] >= 16 * ((second["prompt_tokens"] - 1) // 16) > 0
    assert second["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens_details"]["cached_tokens"]


def test_continuous_usage_stats_in_completion_stream(http):
    events = sse_events(http, COMPLETIONS, {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0,
                                            "ignore_eos": True,
                                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 2
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_beam_search_returns_the_offline_best_beams(http, server, smol_path):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "n": 2, "use_beam_search": True,
            "return_token_ids": True}
    r = http.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and choices[0]["token_ids"] != choices[1]["token_ids"]
    chat = http.post(CHAT, json={"messages": HI, "max_tokens": 4, "n": 2, "use_beam_search": True})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 2
    from pagemill import LLM
    from pagemill.sampling_params import BeamSearchParams

    llm = LLM(smol_path, kv_cache_memory="64MiB", max_model_len=256)
    prompt_ids = r.json()["choices"][0]["prompt_token_ids"]
    offline = llm.beam_search([{"prompt_token_ids": prompt_ids}], BeamSearchParams(beam_width=2, max_tokens=6))[0]
    assert [c["token_ids"] for c in choices] == [s.tokens[len(prompt_ids):] for s in offline.sequences]


def test_logprob_token_ids_return_those_tokens_logprobs(http):
    wanted = http.post("/tokenize", json={"prompt": " red blue", "add_special_tokens": False}).json()["tokens"]
    body = {"messages": HI, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 1,
            "return_tokens_as_token_ids": True}
    full = http.post(CHAT, json={**body, "top_logprobs": 20}).json()["choices"][0]["logprobs"]["content"]
    got = http.post(CHAT, json={**body, "logprob_token_ids": wanted}).json()["choices"][0]["logprobs"]["content"]
    for pos, ref in zip(got, full):
        tops = {t["token"]: t["logprob"] for t in pos["top_logprobs"]}
        assert {f"token_id:{w}" for w in wanted} <= set(tops) and len(tops) <= 1 + len(wanted)
        ref_tops = {t["token"]: t["logprob"] for t in ref["top_logprobs"]}
        for w in wanted:  # where the top 20 also has them, the values agree
            if f"token_id:{w}" in ref_tops:
                assert tops[f"token_id:{w}"] == pytest.approx(ref_tops[f"token_id:{w}"], abs=1e-5)
        assert pos["top_logprobs"][0] == ref["top_logprobs"][0]
    r = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2, "logprobs": 0, "logprob_token_ids": wanted,
                                     "return_tokens_as_token_ids": True})
    assert all({f"token_id:{w}" for w in wanted} <= set(t) for t in r.json()["choices"][0]["logprobs"]["top_logprobs"])
    bad = http.post(CHAT, json={"messages": HI, "logprob_token_ids": wanted})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_token_ids"
