"""Reasoning through a real `pagemill serve --reasoning-parser deepseek_r1` (with hermes tool calls) and the real
openai client: `reasoning` / `reasoning_content` in chat messages and stream deltas, include_reasoning,
thinking_token_budget, structured output and tool calls applied to the answer only, enable_thinking reaching the
template, Responses reasoning items and their events, and 400s naming the field.

SmolLM2-135M is no reasoning model, so its replies are scripted: thinking_token_budget=N lets it think N tokens
(greedy, whatever it says), then the engine forces `</think>`, then a structured_outputs choice forces the answer.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.entrypoints.conftest import MAX_MODEL_LEN, MODEL, RemoteServer
from tests.entrypoints.test_tool_calling_server import SCRIPTS, TOOLS

ASK = [{"role": "user", "content": "What is the capital of France?"}]
ANSWERS = ["Paris", "London"]
BUDGET = 4
SCRIPTED = {"structured_outputs": {"choice": ANSWERS}, "thinking_token_budget": BUDGET}
# ChatML whose generation prompt closes an empty thinking block when enable_thinking is false (as Qwen3's does)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    srv = RemoteServer(["--kv-cache-memory", "256MiB", "--max-model-len", str(MAX_MODEL_LEN),
                        "--disable-uvicorn-access-log", "--reasoning-parser", "deepseek_r1",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", "chatml_tools",
                        "--trust-request-chat-template"],
                       tmp_path_factory.mktemp("reasoning_server") / "server.log")
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(reasoning_server):
    with openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(reasoning_server):
    with httpx.Client(base_url=reasoning_server.url, timeout=120) as c:
        yield c


def end_ids(http) -> list[int]:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "</think>", "add_special_tokens": False})
    return r.json()["tokens"]


def chat(client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 40)
    return client.chat.completions.create(model=MODEL, temperature=0, **kw)


def streamed(client, **kw):
    """(reasoning, reasoning_content, content, tool calls [name, arguments], finish_reason) rebuilt from deltas."""
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 40)
    reasoning = reasoning_content = content = ""
    calls: list[list[str]] = []
    reason = None
    for chunk in client.chat.completions.create(model=MODEL, temperature=0, stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        reason = chunk.choices[0].finish_reason or reason
        extra = d.model_extra or {}
        reasoning += extra.get("reasoning") or ""
        reasoning_content += extra.get("reasoning_content") or ""
        content += d.content or ""
        for t in d.tool_calls or []:
            if t.index == len(calls):
                calls.append([t.function.name, t.function.arguments or ""])
            else:
                calls[t.index][1] += t.function.arguments
    return reasoning or None, reasoning_content or None, content or None, calls, reason


def test_budget_then_forced_end_then_constrained_answer(client, http):
    r = chat(client, extra_body={**SCRIPTED, "return_token_ids": True})
    choice = r.choices[0]
    m = choice.message
    assert m.content in ANSWERS and choice.finish_reason == "stop"
    extra = m.model_extra
    assert extra["reasoning"] and extra["reasoning"] == extra["reasoning_content"]
    assert "think>" not in extra["reasoning"] and "think>" not in m.content
    ids = choice.model_extra["token_ids"]
    end = end_ids(http)
    assert ids[BUDGET:BUDGET + len(end)] == end, ids  # exactly BUDGET thinking tokens, then the forced end marker
    assert r.usage.completion_tokens == len(ids)


def test_stream_equals_the_whole_reply(client):
    whole = chat(client, extra_body=SCRIPTED).choices[0].message
    reasoning, reasoning_content, content, calls, reason = streamed(client, extra_body=SCRIPTED)
    assert reasoning == reasoning_content == whole.model_extra["reasoning"]
    assert content == whole.content and not calls and reason == "stop"


def test_include_reasoning_false_drops_it(client):
    m = chat(client, extra_body={**SCRIPTED, "include_reasoning": False}).choices[0].message
    assert m.content in ANSWERS and m.model_extra.get("reasoning") is None
    assert m.model_extra.get("reasoning_content") is None
    reasoning, reasoning_content, content, _, _ = streamed(client, extra_body={**SCRIPTED, "include_reasoning": False})
    assert reasoning is None and reasoning_content is None and content == m.content


def test_tool_calls_are_parsed_from_the_answer_only(client):
    script, content = SCRIPTS["hermes"]
    body = {"structured_outputs": {"choice": [script]}, "thinking_token_budget": 3}
    r = chat(client, tools=TOOLS, tool_choice="auto", max_tokens=120, extra_body=body)
    m = r.choices[0].message
    assert m.model_extra["reasoning"] and r.choices[0].finish_reason == "tool_calls"
    assert m.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": 1})]
    reasoning, _, s_content, calls, reason = streamed(client, tools=TOOLS, tool_choice="auto", max_tokens=120,
                                                      extra_body=body)
    assert reasoning == m.model_extra["reasoning"] and s_content == content and reason == "tool_calls"
    assert calls == [[c.function.name, c.function.arguments] for c in m.tool_calls]


def test_enable_thinking_reaches_the_template(client):
    off = chat(client, extra_body={"structured_outputs": {"choice": ANSWERS}, "chat_template": TEMPLATE,
                                   "chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True})
    m = off.choices[0].message
    # the prompt closed the thinking: the grammar applies from the first token and the reply is all answer
    assert m.content in ANSWERS and m.model_extra.get("reasoning") is None
    assert off.usage.completion_tokens == len(off.choices[0].model_extra["token_ids"]) <= 3
    on = chat(client, extra_body={**SCRIPTED, "chat_template": TEMPLATE,
                                  "chat_template_kwargs": {"enable_thinking": True}})
    assert on.choices[0].message.model_extra["reasoning"] and on.choices[0].message.content in ANSWERS


def test_responses_reasoning_item(client):
    ref = chat(client, extra_body=SCRIPTED).choices[0].message
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=40, temperature=0, extra_body=SCRIPTED)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == ref.model_extra["reasoning"] and r.output[0].id.startswith("rs_")
    assert r.output_text == ref.content and r.status == "completed"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens


def test_responses_reasoning_events(client):
    ref = client.responses.create(model=MODEL, input=ASK, max_output_tokens=40, temperature=0, extra_body=SCRIPTED,
                                  store=False)
    events = list(client.responses.create(model=MODEL, input=ASK, max_output_tokens=40, temperature=0, stream=True,
                                          extra_body=SCRIPTED, store=False))
    types = [e.type for e in events]
    folded = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1] or not t.endswith(".delta")]
    assert folded == ["response.created", "response.in_progress",
                      "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                      "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                      "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                      "response.output_text.done", "response.content_part.done", "response.output_item.done",
                      "response.completed"], types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thinking == ref.output[0].content[0].text
    assert events[types.index("response.reasoning_text.done")].text == thinking
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == ref.output_text


@pytest.mark.parametrize("body,param", [
    ({"messages": ASK, "thinking_token_budget": -1}, "thinking_token_budget"),
    ({"messages": ASK, "thinking_token_budget": "lots"}, "thinking_token_budget"),
    ({"messages": ASK, "include_reasoning": "maybe"}, "include_reasoning"),
])
def test_bad_input_names_the_field(http, body, param):
    r = http.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- Anthropic Messages: thinking blocks (the same server, through the anthropic SDK) ----
THINK = {"type": "enabled", "budget_tokens": BUDGET}


@pytest.fixture(scope="module")
def claude(reasoning_server):
    anthropic = pytest.importorskip("anthropic")
    with anthropic.Anthropic(base_url=reasoning_server.url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_anthropic_thinking_block_then_text(claude, client):
    msg = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK, thinking=THINK,
                                 extra_body={"temperature": 0})
    # budget_tokens is the thinking budget: the same reply as chat's thinking_token_budget
    want = chat(client, extra_body={"thinking_token_budget": BUDGET}).choices[0].message
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == want.model_extra["reasoning"] and msg.content[0].signature == ""
    assert msg.content[1].text == want.content and "think>" not in msg.content[1].text


def test_anthropic_thinking_stream(claude):
    want = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK, thinking=THINK,
                                  extra_body={"temperature": 0})
    events = list(claude.messages.create(model=MODEL, max_tokens=40, messages=ASK, thinking=THINK, stream=True,
                                         extra_body={"temperature": 0}))
    kinds = [e.type if e.type != "content_block_delta" else e.delta.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    # one thinking block (its deltas, then its signature), then one text block
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["thinking", "text"]
    body = kinds[1:-2]
    first_text = body.index("text_delta")
    assert body[:2] == ["content_block_start", "thinking_delta"]
    assert body[first_text - 4:first_text] == ["thinking_delta", "signature_delta", "content_block_stop",
                                               "content_block_start"]
    assert set(body[first_text:-1]) == {"text_delta"} and body[-1] == "content_block_stop"
    assert "".join(e.delta.thinking for e in events if kinds[events.index(e)] == "thinking_delta") == \
        want.content[0].thinking
    with claude.messages.stream(model=MODEL, max_tokens=40, messages=ASK, thinking=THINK,
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in want.content]


def test_anthropic_thinking_disabled_and_earlier_thinking(claude, client):
    # disabled -> enable_thinking=False for the template (this server's chatml_tools template has no thinking
    # switch, so the reply equals chat's with that kwarg: deepseek_r1 reads it all as thinking)
    msg = claude.messages.create(model=MODEL, max_tokens=12, messages=ASK, thinking={"type": "disabled"},
                                 extra_body={"temperature": 0})
    want = chat(client, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [b.type for b in msg.content] == ["thinking"]
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.choices[0].finish_reason]
    assert msg.content[0].thinking == want.choices[0].message.model_extra["reasoning"]
    # an assistant turn's earlier thinking (Claude Code sends it back) is accepted and left out of the prompt
    turns = [*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hmm.", "signature": "s"},
                                                     {"type": "redacted_thinking", "data": "x"},
                                                     {"type": "text", "text": "Paris."}]},
             {"role": "user", "content": "And of Italy?"}]
    plain = [*ASK, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    assert claude.messages.count_tokens(model=MODEL, messages=turns).input_tokens == \
        claude.messages.count_tokens(model=MODEL, messages=plain).input_tokens
    assert claude.messages.create(model=MODEL, max_tokens=8, messages=turns, thinking=THINK).content


def test_anthropic_thinking_budget_must_be_below_max_tokens(claude):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=ASK, thinking={"type": "enabled",
                                                                                   "budget_tokens": 8})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "budget_tokens" in e.value.body["error"]["message"]
