"""Request fields -> output constraint and tool plan, without a model: response_format, structured_outputs,
guided_*, tools / tool_choice (the JSON schemas that force "required" and named calls), and their 400s."""

from __future__ import annotations

import jsonschema
import pytest
from pydantic import ValidationError

from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagemill.entrypoints.openai.structured_outputs import output_constraint
from pagemill.entrypoints.openai.tool_choice import plan_tools
from pagemill.entrypoints.openai.tool_parsers.forced import AtMostOneCall, NamedFunctionParser, RequiredToolsParser
from pagemill.entrypoints.openai.tool_parsers.hermes import HermesToolParser

HI = [{"role": "user", "content": "Hi"}]
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "integer"}}, "required": ["tz"]}}},
         {"type": "function", "function": {"name": "ping"}}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=HI, **kw)


def error_of(fn, *args) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("fields,kind,value,source", [
    ({"response_format": {"type": "json_object"}}, "json_object", True, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_PARAMS,
                                                                 "strict": True}}},
     "json", WEATHER_PARAMS, "response_format"),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}}, "regex", "[0-9]+",
     "structured_outputs"),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, "json", '{"type": "integer"}', "structured_outputs"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"], "structured_outputs"),
    ({"guided_json": WEATHER_PARAMS}, "json", WEATHER_PARAMS, "guided_json"),
    ({"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, "regex", "a+", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"], "guided_choice"),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"', "guided_grammar"),
])
def test_constraint_from_each_field(fields, kind, value, source):
    for request in (chat(**fields), CompletionRequest(prompt="Hi", **fields)):
        c = output_constraint(request)
        assert c.field == source and c.params.kind == kind and getattr(c.params, kind) == value
    if "disable_any_whitespace" in str(fields):
        assert output_constraint(chat(**fields)).params.disable_any_whitespace


def test_no_constraint():
    assert output_constraint(chat()) is None
    assert output_constraint(chat(response_format={"type": "text"})) is None


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format,guided_regex"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "structured_outputs,guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex,guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"guided_decoding_backend": "nonsense", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
])
def test_constraint_errors_name_the_fields(fields, param):
    err = error_of(output_constraint, chat(**fields))
    assert err.param == param, err.message


@pytest.mark.parametrize("fields,loc", [
    ({"structured_outputs": {"regex": 5}}, "regex"),
    ({"structured_outputs": {"choice": []}}, "choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "yaml"}}, "type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "parameters"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "function"),
])
def test_malformed_fields_fail_validation(fields, loc):
    with pytest.raises(ValidationError) as e:
        chat(**fields)
    assert any(loc in map(str, err["loc"]) for err in e.value.errors()), e.value.errors()


def test_unknown_nested_keys_are_ignored():
    """vLLM's lenient parsing: an unknown key inside structured_outputs is dropped (and logged), not an error."""
    request = chat(structured_outputs={"regex": "a+", "backend": "xgrammar"})
    assert request.structured_outputs.regex == "a+" and request.structured_outputs.ignored_fields == ["backend"]


def test_tool_plan_choices():
    assert plan_tools(chat(), None).parser is None and plan_tools(chat(), None).tools is None
    none = plan_tools(chat(tools=TOOLS, tool_choice="none"), "hermes")
    assert none.parser is None and none.constraint is None and [t["function"]["name"] for t in none.tools] == \
        ["get_weather", "get_time", "ping"]
    auto = plan_tools(chat(tools=TOOLS), "hermes")  # tool_choice defaults to auto with tools
    assert isinstance(auto.parser, HermesToolParser) and auto.constraint is None
    single = plan_tools(chat(tools=TOOLS, tool_choice="auto", parallel_tool_calls=False), "hermes")
    assert isinstance(single.parser, AtMostOneCall)
    named = plan_tools(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}), None)
    assert isinstance(named.parser, NamedFunctionParser) and named.parser.function_name == "get_time"
    assert named.constraint.params.json == TOOLS[1]["function"]["parameters"]
    assert named.constraint.field == "tool_choice" and named.constraint.blamed_field == "tools"
    required = plan_tools(chat(tools=TOOLS, tool_choice="required"), None)
    assert isinstance(required.parser, RequiredToolsParser) and required.constraint.params.kind == "json"


def test_required_schema_accepts_exactly_valid_calls():
    schema = plan_tools(chat(tools=TOOLS, tool_choice="required"), None).constraint.params.json
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [[{"name": "get_weather", "parameters": {"city": "Paris"}}],
          [{"name": "get_time", "parameters": {"tz": 2}}, {"name": "ping", "parameters": {}}]]
    bad = [[], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}],
           [{"name": "get_time", "parameters": {"tz": "x"}}], [{"name": "ping"}],
           [{"name": "ping", "parameters": {}, "extra": 1}], {"name": "ping", "parameters": {}}]
    for value in ok:
        jsonschema.validate(value, schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    single = plan_tools(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok[1], single.constraint.params.json)
    jsonschema.validate(ok[0], single.constraint.params.json)


def test_named_schema_of_a_function_without_parameters():
    plan = plan_tools(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}}), None)
    jsonschema.validate({}, plan.constraint.params.json)


@pytest.mark.parametrize("fields,auto,param,text", [
    ({"tools": TOOLS, "tool_choice": "auto"}, None, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": TOOLS}, None, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "hermes", "tool_choice",
     "nope"),
    ({"tool_choice": "required"}, "hermes", "tool_choice", "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "hermes", "tools", "get_weather"),
])
def test_tool_plan_errors(fields, auto, param, text):
    err = error_of(plan_tools, chat(**fields), auto)
    assert err.param == param and text in err.message


def test_forced_tool_choice_conflicts_with_response_format():
    request = chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    err = error_of(output_constraint, request, plan_tools(request, None).constraint)
    assert err.param == "response_format,tool_choice"
    # auto tool choice adds no constraint, so a scripted constraint may come with it
    request = chat(tools=TOOLS, tool_choice="auto", structured_outputs={"choice": ["x"]})
    assert output_constraint(request, plan_tools(request, "hermes").constraint).field == "structured_outputs"


def test_messages_with_tool_calls_and_results():
    request = ChatCompletionRequest(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3C"}])
    dicts = [m.to_dict() for m in request.messages]
    assert dicts[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert dicts[1]["content"] == "" and dicts[2] == {"role": "tool", "content": "-3C", "tool_call_id": "call_1"}
