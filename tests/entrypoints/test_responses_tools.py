"""/v1/responses with function tools through a real `pagemill serve --enable-auto-tool-choice --tool-call-parser
hermes --chat-template chatml_tools` and the real openai client: tool_choice required / named / auto / none,
function_call output items and their streamed events, function_call / function_call_output input items across
turns (inline and through previous_response_id), and 400s naming the field.

As in test_tool_calling_server, `auto` scripts the model's text with a structured_outputs choice; required and
named calls are forced by the JSON schema of the tools' parameters."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.test_tool_calling_server import ASK, PARAMS, SCRIPTS, TOOLS, start_server
from tests.entrypoints.conftest import MODEL

# The same tools in the Responses API's flat form
RTOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
           "parameters": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    srv = start_server("hermes", tmp_path_factory.mktemp("responses_tools"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tool_server):
    with openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(tool_server):
    with httpx.Client(base_url=tool_server.url, timeout=120) as c:
        yield c


def create(client, **kw):
    kw.setdefault("input", ASK)
    kw.setdefault("max_output_tokens", 120)
    return client.responses.create(model=MODEL, temperature=0, tools=RTOOLS, **kw)


def check_calls(items) -> None:
    assert items
    for item in items:
        assert item.type == "function_call" and item.id.startswith("fc_") and item.call_id.startswith("call_")
        jsonschema.validate(json.loads(item.arguments), PARAMS[item.name])
    assert len({i.call_id for i in items}) == len(items)


def test_required_gives_function_call_items(client):
    r = create(client, tool_choice="required")
    assert r.status == "completed" and r.output_text == ""
    check_calls(r.output)
    assert r.tool_choice == "required" and [t.name for t in r.tools] == ["get_weather", "get_time"]


def test_named_function_streamed(client):
    choice = {"type": "function", "name": "get_weather"}
    whole = create(client, tool_choice=choice, store=False)
    assert [i.name for i in whole.output] == ["get_weather"]
    check_calls(whole.output)
    events = list(create(client, tool_choice=choice, stream=True, store=False))
    types = [e.type for e in events]
    folded = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1] or not t.endswith(".delta")]
    assert folded == ["response.created", "response.in_progress", "response.output_item.added",
                      "response.function_call_arguments.delta", "response.function_call_arguments.done",
                      "response.output_item.done", "response.completed"], types
    added = events[2].item
    assert added.type == "function_call" and added.name == "get_weather" and added.status == "in_progress"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = events[types.index("response.function_call_arguments.done")]
    assert arguments == done.arguments == whole.output[0].arguments
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {added.id}
    final = events[-1].response
    assert final.output[0].arguments == arguments and final.output[0].call_id == added.call_id
    assert final.output[0].status == "completed"


def test_auto_parses_the_model_calls(client):
    script, content = SCRIPTS["hermes"]
    extra = {"structured_outputs": {"choice": [script]}}
    r = create(client, tool_choice="auto", extra_body=extra)
    assert [i.type for i in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == content
    assert [(i.name, json.loads(i.arguments)) for i in r.output[1:]] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": 1})]
    events = list(create(client, tool_choice="auto", extra_body=extra, stream=True))
    final = events[-1].response
    assert [i.type for i in final.output] == ["message", "function_call", "function_call"]
    assert final.output_text == content
    assert [(i.name, i.arguments) for i in final.output[1:]] == [(i.name, i.arguments) for i in r.output[1:]]
    for item in final.output[1:]:
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                         and e.item_id == item.id)
        assert deltas == item.arguments
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == [0, 1, 2] and sorted(done) == [0, 1, 2]


def test_none_shows_the_tools_but_calls_nothing(client):
    r = create(client, tool_choice="none", max_output_tokens=8)
    assert [i.type for i in r.output] == ["message"]


def test_function_call_outputs_across_turns(client):
    first = create(client, tool_choice={"type": "function", "name": "get_time"})
    call = first.output[0]
    second = client.responses.create(
        model=MODEL, temperature=0, tools=RTOOLS, previous_response_id=first.id, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "It is 13:00."}])
    assert second.status in ("completed", "incomplete") and second.output[0].type == "message"
    # the same conversation given inline: function_call and function_call_output items
    inline = client.responses.create(
        model=MODEL, temperature=0, tools=RTOOLS, max_output_tokens=8,
        input=ASK + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                      "arguments": call.arguments},
                     {"type": "function_call_output", "call_id": call.call_id, "output": "It is 13:00."}])
    assert inline.output_text == second.output_text
    assert inline.usage.input_tokens == second.usage.input_tokens > first.usage.input_tokens


@pytest.mark.parametrize("body,param", [
    ({"tools": RTOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": RTOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format,tool_choice"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]},
     "input.0.arguments"),
    ({"thinking_token_budget": 5}, "thinking_token_budget"),  # no --reasoning-parser on this server
])
def test_bad_input_names_the_field(http, body, param):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()  # (with the other fields it names, if any)
