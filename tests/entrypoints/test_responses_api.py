"""POST /v1/responses through a real `pagemill serve` and the real openai client: greedy text equal to the chat
completion's, streamed events, instructions, max_output_tokens, json_schema output, logprobs, the in-memory store
(GET and previous_response_id), and 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import MODEL

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three colors of the rainbow."}]
SAY_HI = [{"role": "user", "content": "Say hi."}]  # a reply that ends on its own within 40 tokens
PERSON = "Invent a person: give their name and age as JSON."
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                 "required": ["name", "age"], "additionalProperties": False}
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
          "response.output_text.delta", "response.output_text.done", "response.content_part.done",
          "response.output_item.done", "response.completed"]


def chat(client, messages, max_tokens: int, **kw):
    """The greedy chat completion of the same conversation (the oracle of the responses' text)."""
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return r


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of deltas folded into one."""
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1] or t != "response.output_text.delta"]


def test_text_equals_chat_completion(client):
    ref = chat(client, MESSAGES, 24)
    r = client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=24, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == ref.choices[0].message.content
    message = r.output[0]
    assert len(r.output) == 1 and message.type == "message" and message.role == "assistant"
    assert [p.type for p in message.content] == ["output_text"] and message.content[0].annotations == []
    expected_status = "incomplete" if ref.choices[0].finish_reason == "length" else "completed"
    assert r.status == message.status == expected_status
    assert (r.usage.input_tokens, r.usage.output_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    again = client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=24, temperature=0)
    assert again.output_text == r.output_text
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens  # a prefix-cache hit


def test_content_parts_developer_role_and_instructions(client):
    ref = chat(client, MESSAGES, 16)
    parts = [{"role": "developer", "content": [{"type": "input_text", "text": MESSAGES[0]["content"]}]},
             {"role": "user", "content": [{"type": "input_text", "text": MESSAGES[1]["content"]}]}]
    r = client.responses.create(model=MODEL, input=parts, max_output_tokens=16, temperature=0)
    assert r.output_text == ref.choices[0].message.content
    r2 = client.responses.create(model=MODEL, instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"],
                                 max_output_tokens=16, temperature=0)
    assert r2.output_text == ref.choices[0].message.content and r2.instructions == MESSAGES[0]["content"]


def test_streamed_events(client):
    ref = client.responses.create(model=MODEL, input=SAY_HI, max_output_tokens=40, temperature=0, store=False)
    assert ref.status == "completed", "the test wants a reply that ends on its own"
    events = list(client.responses.create(model=MODEL, input=SAY_HI, max_output_tokens=40, temperature=0,
                                          stream=True, store=False))
    types = [e.type for e in events]
    assert collapse(types) == EVENTS, types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and all(deltas)
    final = events[-1].response
    assert "".join(deltas) == final.output_text == ref.output_text
    assert events[types.index("response.output_text.done")].text == ref.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.status == "completed" and final.usage.output_tokens == ref.usage.output_tokens
    ids = {e.item_id for e in events if hasattr(e, "item_id")} | {events[2].item.id, final.output[0].id}
    assert len(ids) == 1 and final.id == events[0].response.id


def test_streamed_events_are_named(http):
    """Each SSE event has an `event:` line naming its type, as OpenAI sends them (and no [DONE])."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True, "store": False}
    with http.stream("POST", "/v1/responses", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[len("data: "):])["type"] == event_line[len("event: "):]
    assert blocks[-1].startswith("event: response.incomplete")


def test_max_output_tokens_gives_incomplete(client):
    r = client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3 and r.max_output_tokens == 3
    events = list(client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=3, temperature=0,
                                          stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == r.output_text


def test_json_schema_output(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON_SCHEMA, "strict": True}
    r = client.responses.create(model=MODEL, input=PERSON, max_output_tokens=80, temperature=0,
                                text={"format": fmt})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON_SCHEMA)
    assert r.text.format.type == "json_schema"
    obj = client.responses.create(model=MODEL, input=PERSON, max_output_tokens=120, temperature=0,
                                  text={"format": {"type": "json_object"}})
    assert obj.status == "completed" and isinstance(json.loads(obj.output_text), dict)


def test_logprobs_equal_chat_logprobs(client):
    ref = chat(client, MESSAGES, 8, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    r = client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=8, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == len(ref) == r.usage.output_tokens
    assert "".join(lp.token for lp in lps) == r.output_text
    for got, want in zip(lps, ref):
        assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
    streamed = list(client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=8, temperature=0,
                                            top_logprobs=2, stream=True))
    per_delta = [lp.token for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert per_delta == [lp.token for lp in lps]


def test_store_and_retrieve(client):
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.status == r.status
    assert got.usage.output_tokens == r.usage.output_tokens
    unstored = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    streamed = list(client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4, stream=True))
    assert client.responses.retrieve(streamed[-1].response.id).output_text == streamed[-1].response.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, instructions="Answer briefly.", input="Name a fruit.",
                                    max_output_tokens=12, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="Name another one.",
                                     max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id
    # the first response's instructions are not carried over (OpenAI's rule)
    ref = chat(client, [{"role": "user", "content": "Name a fruit."},
                        {"role": "assistant", "content": first.output_text},
                        {"role": "user", "content": "Name another one."}], 12)
    assert second.output_text == ref.choices[0].message.content
    assert second.usage.input_tokens == ref.usage.prompt_tokens
    # the same conversation sent by hand, the first response's output items passed back as input
    manual = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Name a fruit."}, *first.output,
                                                         {"role": "user", "content": "Name another one."}],
                                     max_output_tokens=12, temperature=0)
    assert manual.output_text == second.output_text
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model=MODEL, previous_response_id="resp_unknown", input="Hi", max_output_tokens=2)
    assert exc.value.body["param"] == "previous_response_id"


def test_unknown_field_is_ignored_with_a_header(http):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_tokens": 5, "max_output_tokens": 3})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "max_tokens"
    assert r.json()["usage"]["output_tokens"] <= 3


@pytest.mark.parametrize("body,param", [
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice"),  # auto: no parser
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"role": "user", "content": "a\ud800b"}]}, "input.0.content"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "Hi", "temperature": -1.0}, "temperature"),
    ({"input": "Hi", "top_logprobs": 10**4}, "top_logprobs"),
    ({"input": "Hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "Hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "truncation": "auto"}, "truncation"),
    ({"input": "Hi", "store": "yes"}, "store"),
])
def test_bad_input_names_the_field(http, body, param):
    r = http.post("/v1/responses", content=json.dumps({"model": MODEL, **body}),  # (escapes lone surrogates)
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error


def test_unknown_model_and_id_are_404(http):
    r = http.post("/v1/responses", json={"model": "nope", "input": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = http.get("/v1/responses/resp_nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_openapi_documents_the_routes(http):
    paths = http.get("/openapi.json").json()["paths"]
    assert "text/event-stream" in paths["/v1/responses"]["post"]["responses"]["200"]["content"]
    assert "404" in paths["/v1/responses/{response_id}"]["get"]["responses"]


def test_dropped_stream_frees_its_request(server, http):
    """A client that leaves a stream early aborts its request: nothing runs and the KV pool is free again."""
    body = {"model": MODEL, "input": "Write a long story.", "max_output_tokens": 1900, "ignore_eos": True,
            "stream": True, "store": False}
    with http.stream("POST", "/v1/responses", json=body) as resp:
        deltas = 0
        for line in resp.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 3:
                break
    assert deltas == 3
    server.wait_idle(timeout_s=5)  # (the whole reply would take far longer)
