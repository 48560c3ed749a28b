"""Tool calling through a real `pagemill serve --enable-auto-tool-choice --tool-call-parser hermes --chat-template
chatml_tools` and the real openai client: tool_choice none / auto / required / named, streamed and not, tool
results in the conversation, and the 400s.

SmolLM2-135M answers in prose rather than calling tools, so the `auto` tests script the model's text: a
constraint that allows only the script (structured_outputs.choice) comes with tools and tool_choice="auto", the
model emits exactly the script, and the parser turns it into tool_calls. The required / named tests' calls are
forced by a JSON schema built from the tools' parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import MAX_MODEL_LEN, MODEL, RemoteServer

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"tz": {"type": "integer", "minimum": -12, "maximum": 14}},
               "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a UTC offset",
                                           "parameters": TIME_PARAMS}}]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in UTC+1?"}]
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": 1})]
# parser -> (a scripted model text, the content the parser leaves)
SCRIPTS = {
    "hermes": ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": 1}}\n</tool_call>',
               "Let me look that up.\n"),
    "xlam": ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
             '{"name": "get_time", "arguments": {"tz": 1}}]</tool_call>', None),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"tz": 1}}', None),
    "pythonic": ("[get_weather(city='Paris', unit=\"celsius\"), get_time(tz=1)]", None),
    "mistral": ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]'
                '{"tz": 1}', "Sure."),
    "qwen3_coder": ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_time>\n<parameter=tz>\n1\n</parameter>\n</function>\n</tool_call>",
                    "Checking.\n"),
}


def start_server(parser: str, log_dir: Path) -> RemoteServer:
    srv = RemoteServer(["--kv-cache-memory", "256MiB", "--max-model-len", str(MAX_MODEL_LEN),
                        "--disable-uvicorn-access-log", "--enable-auto-tool-choice", "--tool-call-parser", parser,
                        "--chat-template", "chatml_tools"], log_dir / f"server-{parser}.log")
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    srv = start_server("hermes", tmp_path_factory.mktemp("tool_server"))
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


@dataclass
class Reply:
    """A reply's content, calls [(id, name, arguments)] and finish reason, from a response or a stream."""

    content: str | None
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    finish_reason: str | None = None

    def names_and_arguments(self) -> list[tuple[str, str]]:
        return [(name, args) for _, name, args in self.calls]


def create(client, messages=ASK, **kw) -> Reply:
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)
    m = r.choices[0].message
    calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
    assert all(c.type == "function" for c in m.tool_calls or [])
    return Reply(m.content, calls, r.choices[0].finish_reason)


def stream(client, messages=ASK, **kw) -> Reply:
    """Rebuild the reply from the deltas as OpenAI clients do, checking their shape on the way."""
    content, calls, reason = None, [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for d in choice.delta.tool_calls or []:
            if d.index == len(calls):  # a call's first piece names it
                assert d.id and d.type == "function" and d.function.name
                calls.append([d.id, d.function.name, d.function.arguments or ""])
            else:
                assert d.id is None and d.function.name is None and d.index < len(calls)
                calls[d.index][2] += d.function.arguments
    return Reply(content, [tuple(c) for c in calls], reason)


def check_calls_validate(reply: Reply) -> None:
    assert reply.calls and reply.finish_reason == "tool_calls"
    assert reply.content in (None, "")
    ids = [c[0] for c in reply.calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("chatcmpl-tool-") for i in ids)
    for _, name, arguments in reply.calls:
        jsonschema.validate(json.loads(arguments), PARAMS[name])


def scripted(parser: str) -> dict:
    return {"extra_body": {"structured_outputs": {"choice": [SCRIPTS[parser][0]]}}}


# ---- what the server does alone ----
def test_auto_with_prose_reply_streams_like_the_plain_reply(client):
    """Whatever the model says (prose, most likely), streamed and plain replies agree exactly."""
    kw = dict(tools=TOOLS, tool_choice="auto", max_tokens=40)
    plain, streamed = create(client, **kw), stream(client, **kw)
    assert streamed.content == plain.content and streamed.finish_reason == plain.finish_reason
    assert streamed.names_and_arguments() == plain.names_and_arguments()
    assert plain.content or plain.calls
    assert "<|im_end|>" not in (plain.content or "")


def test_tool_choice_none_shows_tools_but_calls_none(client, http):
    with_tools = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                                max_tokens=5, temperature=0)
    assert with_tools.choices[0].message.tool_calls is None and with_tools.choices[0].message.content
    without = http.post("/tokenize", json={"messages": ASK}).json()["count"]
    rendered = http.post("/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    assert with_tools.usage.prompt_tokens == rendered["count"] > without
    assert "<tools>" in http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]


def test_tool_results_round_trip(client, http):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.content
    rendered = http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert r.usage.prompt_tokens == rendered["count"]
    text = http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
            in text)
    assert "<tool_response>\n22 degrees, sunny\n</tool_response>\n<tool_response>\n14:05\n</tool_response>" in text


TOOL_CASES = [
    ("named_not_in_tools", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ("required_without_tools", {"tool_choice": "required"}, "tool_choice", "tools"),
    ("tool_without_name", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name",
     "required"),
    ("tool_bad_type", {"tools": [{"type": "search", "function": {"name": "f"}}]}, "tools.0.type", ""),
    ("tool_parameters_not_object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools.0.function.parameters", ""),
    ("duplicate_tools", {"tools": TOOLS + TOOLS[:1]}, "tools", "get_weather"),
    ("tool_choice_bad_value", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice", ""),
    ("tool_message_without_id", {"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages.1.tool_call_id",
     "tool_call_id"),
    ("tool_calls_on_user", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls",
     "assistant"),
    ("forced_tool_and_response_format", {"tools": TOOLS, "tool_choice": "required",
                                         "response_format": {"type": "json_object"}},
     "response_format,tool_choice", "response_format"),
]


@pytest.mark.parametrize("body,param,text", [c[1:] for c in TOOL_CASES], ids=[c[0] for c in TOOL_CASES])
def test_bad_tool_requests_are_400s(http, body, param, text):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 3, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text.lower() in err["message"].lower(), err


def test_healthy_after_bad_tool_requests(client, tool_server):
    assert create(client, max_tokens=3).content
    tool_server.wait_idle()


# ---- what needs the engine to enforce constraints ----
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "single"])
def test_required(client, parallel):
    kw = dict(tools=TOOLS, tool_choice="required", max_tokens=120, parallel_tool_calls=parallel)
    plain = create(client, **kw)
    check_calls_validate(plain)
    if not parallel:
        assert len(plain.calls) == 1
    streamed = stream(client, **kw)
    check_calls_validate(streamed)
    assert streamed.names_and_arguments() == plain.names_and_arguments()


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_function(client, name):
    kw = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}}, max_tokens=80)
    plain = create(client, **kw)
    check_calls_validate(plain)
    assert [c[1] for c in plain.calls] == [name]
    streamed = stream(client, **kw)
    assert streamed.names_and_arguments() == plain.names_and_arguments()
    assert streamed.finish_reason == "tool_calls"


def check_scripted_auto(client, parser: str) -> None:
    kw = dict(tools=TOOLS, tool_choice="auto", max_tokens=120, **scripted(parser))
    plain = create(client, **kw)
    assert plain.content == SCRIPTS[parser][1] and plain.finish_reason == "tool_calls"
    assert [(name, json.loads(args)) for _, name, args in plain.calls] == EXPECTED_CALLS
    streamed = stream(client, **kw)
    assert streamed.content == plain.content and streamed.finish_reason == "tool_calls"
    assert streamed.names_and_arguments() == plain.names_and_arguments()


def test_auto_hermes_scripted(client):
    check_scripted_auto(client, "hermes")


def test_auto_without_parallel_calls_keeps_the_first(client):
    reply = create(client, tools=TOOLS, tool_choice="auto", max_tokens=120, parallel_tool_calls=False,
                   **scripted("hermes"))
    assert [(name, json.loads(args)) for _, name, args in reply.calls] == EXPECTED_CALLS[:1]
    assert stream(client, tools=TOOLS, tool_choice="auto", max_tokens=120, parallel_tool_calls=False,
                  **scripted("hermes")).names_and_arguments() == reply.names_and_arguments()


@pytest.mark.parametrize("parser", ["xlam", "llama3_json", "pythonic", "mistral", "qwen3_coder"])
def test_auto_other_parsers_scripted(parser, tmp_path):
    srv = start_server(parser, tmp_path)
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            check_scripted_auto(c, parser)
    finally:
        srv.stop()
