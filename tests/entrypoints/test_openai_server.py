"""The OpenAI endpoints through the real `openai` client: models, completions, chat, streaming, logprobs, n, stop."""

from __future__ import annotations

import pytest

import pagemill
from tests.entrypoints.conftest import MAX_MODEL_LEN, MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def greedy(client):
    """The non-streamed greedy reply to QUESTION (12 tokens at most)."""
    return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)


def test_models_list(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "pagemill"
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_version_and_health(http):
    assert http.get("/version").json() == {"version": pagemill.__version__}
    assert http.get("/health").status_code == 200


def test_completion_prompt_forms(client, http):
    """A list of strings, one string, token ids and a list of token-id lists give the same greedy texts."""
    kw = dict(model=MODEL, max_tokens=4, temperature=0)
    both = client.completions.create(prompt=["The capital of France is", "Water boils at"], **kw)
    assert both.object == "text_completion" and [c.index for c in both.choices] == [0, 1]
    texts = [c.text for c in both.choices]
    assert all(t.strip() for t in texts) and all(c.finish_reason in ("length", "stop") for c in both.choices)
    a = client.completions.create(prompt="The capital of France is", **kw)
    assert a.choices[0].text == texts[0]
    ids_a = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    ids_b = http.post("/tokenize", json={"prompt": "Water boils at"}).json()["tokens"]
    assert a.usage.prompt_tokens == len(ids_a)
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    assert client.completions.create(prompt=ids_a, **kw).choices[0].text == texts[0]
    by_ids = client.completions.create(prompt=[ids_a, ids_b], **kw)
    assert [c.text for c in by_ids.choices] == texts
    assert by_ids.usage.prompt_tokens == both.usage.prompt_tokens == len(ids_a) + len(ids_b)


def test_chat_greedy_and_usage(client, http, greedy):
    r = greedy
    (choice,) = r.choices
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    rendered = http.post("/tokenize", json={"messages": QUESTION}).json()
    assert r.usage.prompt_tokens == rendered["count"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # max_completion_tokens and ignore_eos (a vLLM extra field) give exactly that many tokens
    r2 = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=7, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r2.usage.completion_tokens == 7 and r2.choices[0].finish_reason == "length"
    assert choice.message.content.startswith(r2.choices[0].message.content)


def test_streaming_chat_reassembles_to_greedy_text(client, greedy):
    full = greedy
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    last, first = chunks[-1].usage, full.usage
    assert (last.prompt_tokens, last.completion_tokens, last.total_tokens) == \
        (first.prompt_tokens, first.completion_tokens, first.total_tokens)
    # The same prompt again: its full blocks come from the prefix cache, and usage says so.
    assert last.prompt_tokens_details.cached_tokens >= first.prompt_tokens_details.cached_tokens
    assert last.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_streaming_completion_matches(client):
    kw = dict(model=MODEL, prompt="Once upon a time, in a small village,", max_tokens=8, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6
        assert bytes(t.bytes).decode() == t.token
    # streamed logprobs carry the same tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=6, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tok in top and max(top.values()) == tlp  # greedy: the chosen token is the best one
        assert 1 <= len(top) <= 2


def test_n3_seeded_sampling(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a short story."}], max_tokens=5, n=3,
              temperature=1.0, seed=42, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    chunks = list(client.chat.completions.create(stream=True, **kw))  # same seeds: same texts
    streamed = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)}
    assert [streamed[i] for i in range(3)] == texts


def test_stop_strings(client, greedy):
    text = greedy.choices[0].message.content
    assert "Paris" in text
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, stop=["Paris"])
    assert r.choices[0].message.content == text[:text.index("Paris")]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == "Paris"
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                                 stop="Paris", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text[:text.index("Paris")]
    kept = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                          stop=["Paris"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == text[:text.index("Paris") + len("Paris")]


def test_continue_final_message(client):
    messages = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert "Paris" in r.choices[0].message.content


def test_request_chat_template(client):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The capital of France is"}],
                                       max_tokens=6, temperature=0, extra_body={"chat_template": template})
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].text
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens


def test_tokenize_detokenize_roundtrip(http):
    r = http.post("/tokenize", json={"prompt": "Hello, world! Déjà vu."}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello, world! Déjà vu."}


def test_metrics_exposition(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    m = server.wait_idle()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total",
                 "num_preemptions_total", "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"):
        assert f"pagemill:{name}" in m, name
    assert m['pagemill:request_success_total{finished_reason="length"}'] >= 1
    assert m["pagemill:kv_cache_usage_perc"] == 0.0


def test_reset_prefix_cache_when_idle(server, http):
    server.wait_idle()
    assert http.post("/reset_prefix_cache").json() == {"success": True}
