"""Anthropic's Messages API on a real `pagemill serve`, through the official `anthropic` SDK: text, system prompts,
stop sequences, streaming (the SDK checks the event sequence), forced tool use and tool results across turns,
count_tokens, and Anthropic-shaped errors."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.conftest import API_KEY, MODEL

anthropic = pytest.importorskip("anthropic")

GREEDY = {"temperature": 0}  # (the SDK sends sampling fields through extra_body; the API still takes them)
SYSTEM = "You are a helpful assistant. Answer briefly."
ASK = [{"role": "user", "content": "Name three fruits."}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"type": "string", "enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def _chat_text(client, max_tokens: int, **extra) -> str:
    """The same conversation through /v1/chat/completions, greedy."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *ASK],
                                       max_tokens=max_tokens, temperature=0, **extra)  # (openai client)
    return r.choices[0].message.content


def test_create_equals_the_chat_answer(claude, client):
    msg = claude.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, messages=ASK, extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == _chat_text(client, 24)
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert msg.usage.input_tokens > 10 and 0 < msg.usage.output_tokens <= 24
    if msg.stop_reason == "max_tokens":
        assert msg.usage.output_tokens == 24


def test_stop_sequence(claude, client):
    free = _chat_text(client, 24)
    word = free.split()[2]  # a word the greedy answer reaches
    msg = claude.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, messages=ASK, extra_body=GREEDY,
                                 stop_sequences=["zzzz", word])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == word
    assert free.startswith(msg.content[0].text) and word not in msg.content[0].text


def test_stream_equals_create(claude):
    want = claude.messages.create(model=MODEL, max_tokens=20, system=SYSTEM, messages=ASK, extra_body=GREEDY)
    with claude.messages.stream(model=MODEL, max_tokens=20, system=SYSTEM, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want.content[0].text == final.content[0].text
    assert final.stop_reason == want.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (want.usage.input_tokens,
                                                                      want.usage.output_tokens)


def test_raw_event_sequence(server):
    """The events in Anthropic's order, each with its `type` repeated in the data."""
    import httpx

    body = {"model": MODEL, "max_tokens": 8, "messages": ASK, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[1] == "content_block_start"
    assert set(events[2:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_then_result(claude, stream):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    if stream:
        with claude.messages.stream(**kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = claude.messages.create(**kwargs)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1
    use = uses[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    assert set(use.input) == {"city", "unit"} and use.input["unit"] in ("c", "f")
    # (tool_choice auto, the default with tools, needs --enable-auto-tool-choice, as on the chat API)
    reply = claude.messages.create(model=MODEL, max_tokens=16, tools=[WEATHER], tool_choice={"type": "none"},
                                   extra_body=GREEDY, messages=[
        *ask, {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}])
    assert reply.content and reply.content[0].type == "text" and reply.usage.input_tokens > msg.usage.input_tokens


def test_count_tokens_equals_the_prompt(claude):
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    msg = claude.messages.create(model=MODEL, max_tokens=1, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == msg.usage.input_tokens
    with_tools = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK, tools=[WEATHER])
    assert with_tools.input_tokens >= counted.input_tokens


def test_errors_have_anthropic_shape(claude, server):
    import httpx

    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": API_KEY}, json={"model": MODEL,
                                                                                     "messages": ASK})
    assert r.status_code == 400 and "max_tokens" in json.loads(r.text)["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as bad:
            bad.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    too_long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4, messages=too_long)
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_thinking_without_a_reasoning_parser(claude, client):
    # no --reasoning-parser: the budget has nothing to count, the reply is plain text as without `thinking`
    msg = claude.messages.create(model=MODEL, max_tokens=16, system=SYSTEM, messages=ASK, extra_body=GREEDY,
                                 thinking={"type": "enabled", "budget_tokens": 8})
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == _chat_text(client, 16, extra_body={"chat_template_kwargs": {"enable_thinking": True}})


def test_thinking_maps_to_chat_fields():
    from pagemill.entrypoints.anthropic.protocol import MessagesRequest
    from pagemill.entrypoints.anthropic.serving_messages import chat_request

    def fields(thinking, reasoning=True):
        r = chat_request(MessagesRequest.model_validate({"model": MODEL, "max_tokens": 64, "messages": ASK,
                                                         "thinking": thinking}), reasoning)
        return r.chat_template_kwargs, r.thinking_token_budget

    assert fields({"type": "enabled", "budget_tokens": 32}) == ({"enable_thinking": True}, 32)
    assert fields({"type": "enabled", "budget_tokens": 32}, reasoning=False) == ({"enable_thinking": True}, None)
    assert fields({"type": "disabled"}) == ({"enable_thinking": False}, None)
    assert fields(None) == (None, None)
