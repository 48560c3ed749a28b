"""The Responses API's pieces without a server: the bounded store, the request model's input forms and errors,
the text.format constraint, and the event writer."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.protocol_responses import ResponsesRequest, ResponsesResponse
from pagemill.entrypoints.openai.responses_store import ResponsesStore
from pagemill.entrypoints.openai.serving_responses import (EventWriter, check_supported, conversation_items,
                                                           response_id, text_format_constraint, tool_plan)


def stored(rid: str) -> ResponsesResponse:
    return ResponsesResponse(id=rid, status="completed", model="m")


def test_store_drops_the_least_recently_used():
    store = ResponsesStore(max_entries=2)
    store.put(stored("a"), [{"role": "user", "content": "1"}])
    store.put(stored("b"), [])
    assert store.get("a").conversation == [{"role": "user", "content": "1"}]  # a is now the most recent
    store.put(stored("c"), [])
    assert len(store) == 2 and store.get("b") is None and store.get("a") and store.get("c")
    with pytest.raises(ValueError, match="max_entries"):
        ResponsesStore(max_entries=0)


def test_input_forms_render_as_chat_messages():
    r = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "a", "annotations": []}, {"type": "output_text", "text": "b"}]},
    ]})
    assert [m.to_dict() for m in r.input] == [{"role": "system", "content": "Be brief."},
                                              {"role": "assistant", "content": "a\nb"}]
    assert ResponsesRequest.model_validate({"input": "hi"}).input == "hi"


def test_a_bad_item_is_reported_against_the_list_form():
    with pytest.raises(ValidationError) as exc:
        ResponsesRequest.model_validate({"input": [{"role": "robot", "content": "hi"}]})
    assert "'user', 'system', 'developer' or 'assistant'" in str(exc.value)


def test_sampling_request_carries_the_shared_fields():
    r = ResponsesRequest.model_validate({"input": "hi", "temperature": 0.5, "top_k": 3, "seed": 7, "stop": ["x"],
                                         "repetition_penalty": 1.1, "stream": True})
    s = r.sampling_request()
    assert (s.temperature, s.top_k, s.seed, s.stop, s.repetition_penalty, s.stream) == (0.5, 3, 7, ["x"], 1.1, True)


@pytest.mark.parametrize("body,param", [
    ({"include": ["file_search_call.results"]}, "include"),
    ({"background": True}, "background"),
])
def test_unsupported_fields_name_themselves(body, param):
    with pytest.raises(OpenAIError) as exc:
        check_supported(ResponsesRequest.model_validate({"input": "hi", **body}))
    assert exc.value.param == param and exc.value.status == 400


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "name": "f"}]}, "tool_choice"),  # auto needs --enable-auto-tool-choice
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),  # no tools
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}], "tool_choice": "required"},
     "tools"),
])
def test_tool_plan_errors_name_the_field(body, param):
    with pytest.raises(OpenAIError) as exc:
        tool_plan(ResponsesRequest.model_validate({"input": "hi", **body}), None)
    assert exc.value.param == param and exc.value.status == 400


def test_tool_plan_and_items_render_as_chat_messages():
    request = ResponsesRequest.model_validate({
        "input": [{"role": "user", "content": "weather?"},
                  {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                                  "text": "hmm"}]},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "X"}'},
                  {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                  {"type": "function_call_output", "call_id": "call_2",
                   "output": [{"type": "input_text", "text": "noon"}]}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
                  {"type": "function", "name": "get_time"}],
        "tool_choice": {"type": "function", "name": "get_time"}})
    assert conversation_items(request.input) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "X"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    plan = tool_plan(request, None)
    assert [t["function"]["name"] for t in plan.tools] == ["get_weather", "get_time"]
    assert plan.constraint.params.json == {"type": "object", "properties": {}}  # get_time's (no) parameters


def test_text_format_constraints():
    def constraint(fmt):
        return text_format_constraint(ResponsesRequest.model_validate({"input": "hi", "text": {"format": fmt}}))

    assert constraint({"type": "text"}) is None
    assert constraint({"type": "json_object"}).params.json_object is True
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = constraint({"type": "json_schema", "name": "x", "schema": schema})
    assert c.params.json == schema and c.field == "text.format"


def test_event_writer_numbers_and_names_events():
    event = EventWriter()
    first, second = event("response.created", response=stored(response_id())), event("x.y", delta="d")
    assert first.startswith("event: response.created\ndata: ") and first.endswith("\n\n")
    assert json.loads(first.split("data: ", 1)[1])["sequence_number"] == 0
    assert json.loads(second.split("data: ", 1)[1]) == {"type": "x.y", "sequence_number": 1, "delta": "d"}
