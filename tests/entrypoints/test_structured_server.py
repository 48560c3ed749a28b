"""Structured output through a real `pagemill serve` and the real openai client: response_format (json_object,
json_schema, the SDK's `parse`), vLLM's structured_outputs, the older guided_* fields, and their 400s."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.entrypoints.conftest import MODEL

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
PERSON = [{"role": "user", "content": "Invent a person: give their name and age as JSON."}]
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                 "required": ["name", "age"], "additionalProperties": False}
KW = dict(model=MODEL, temperature=0)


class Person(BaseModel):
    name: str
    age: int


def chat_text(client, messages=PERSON, max_tokens=80, **kw) -> tuple[str, str]:
    r = client.chat.completions.create(messages=messages, max_tokens=max_tokens, **KW, **kw)
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_json_object(client):
    text, reason = chat_text(client, response_format={"type": "json_object"}, max_tokens=120)
    assert reason == "stop" and isinstance(json.loads(text), dict), text


def test_json_schema(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    text, reason = chat_text(client, response_format=rf)
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_json_schema_streamed(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    chunks = list(client.chat.completions.create(messages=PERSON, max_tokens=80, response_format=rf, stream=True,
                                                 **KW))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    assert (text, "stop") == chat_text(client, response_format=rf)


def test_sdk_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=PERSON, response_format=Person, max_tokens=80,
                                      temperature=0)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


def follows(schema: dict) -> object:
    """A check that a text is JSON following `schema`."""
    def check(text: str) -> bool:
        jsonschema.validate(json.loads(text), schema)
        return True
    return check


def matches(pattern: str) -> object:
    return lambda text: re.fullmatch(pattern, text) is not None


@pytest.mark.parametrize("extra,check", [
    ({"guided_json": PERSON_SCHEMA}, follows(PERSON_SCHEMA)),
    ({"guided_regex": r"[A-Z][a-z]{2,8} is [0-9]{2}"}, matches(r"[A-Z][a-z]{2,8} is [0-9]{2}")),
    ({"guided_choice": ["red", "green", "blue"]}, matches("red|green|blue")),
    ({"guided_grammar": 'root ::= ("yes" | "no")'}, matches("yes|no")),
    ({"guided_regex": r"\d{3}", "guided_decoding_backend": "xgrammar"}, matches(r"\d{3}")),
    ({"structured_outputs": {"json": PERSON_SCHEMA, "disable_any_whitespace": True}},
     # no whitespace between JSON tokens (compact "," and ":" separators)
     lambda t: follows(PERSON_SCHEMA)(t) and "\n" not in t and "  " not in t),
    ({"structured_outputs": {"choice": ["Paris", "London"]}}, matches("Paris|London")),
    ({"structured_outputs": {"regex": "(yes|no)!"}}, matches("(yes|no)!")),
    ({"structured_outputs": {"grammar": 'root ::= "a" ("b" | "bb")'}}, matches("ab{1,2}")),
], ids=["guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_backend", "so_json",
        "so_choice", "so_regex", "so_grammar"])
def test_constraint_fields_chat_and_completions(client, extra, check):
    text, reason = chat_text(client, max_tokens=60, extra_body=extra)
    assert check(text) and reason == "stop", text
    r = client.completions.create(model=MODEL, prompt="Answer: ", max_tokens=60, temperature=0, extra_body=extra)
    assert check(r.choices[0].text) and r.choices[0].finish_reason == "stop", r.choices[0].text


def test_choice_streamed_completion(client):
    chunks = list(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=10, temperature=0,
                                            stream=True, extra_body={"guided_choice": ["blue", "green"]}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) in ("blue", "green")


# (case id, path, body, the field the 400 names)
SERVER_ONLY_CASES = [
    ("two_sources", CHAT, {"messages": HI, "response_format": {"type": "json_object"}, "guided_regex": "a"},
     "response_format,guided_regex"),
    ("two_guided", COMPLETIONS, {"prompt": "Hi", "guided_regex": "a", "guided_choice": ["b"]},
     "guided_regex,guided_choice"),
    ("so_and_guided", CHAT, {"messages": HI, "structured_outputs": {"regex": "a"}, "guided_json": {}},
     "structured_outputs,guided_json"),
    ("two_kinds_in_structured_outputs", CHAT, {"messages": HI, "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("empty_structured_outputs", CHAT, {"messages": HI, "structured_outputs": {}}, "structured_outputs"),
    # an unknown key is ignored (vLLM's lenient parsing), which leaves no constraint at all
    ("only_an_unknown_structured_outputs_key", CHAT, {"messages": HI, "structured_outputs": {"backend": "xgrammar"}},
     "structured_outputs"),
    ("regex_wrong_type", CHAT, {"messages": HI, "structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ("empty_choice", CHAT, {"messages": HI, "guided_choice": []}, "guided_choice"),
    ("schema_text_not_json", CHAT, {"messages": HI, "guided_json": "{nope"}, "guided_json"),
    ("unknown_backend", CHAT, {"messages": HI, "guided_regex": "a", "guided_decoding_backend": "nonsense"},
     "guided_decoding_backend"),
    ("unknown_response_format", CHAT, {"messages": HI, "response_format": {"type": "yaml"}}, "response_format.type"),
    ("json_schema_missing", CHAT, {"messages": HI, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("json_schema_without_schema", COMPLETIONS, {"prompt": "Hi", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
]

# Invalid constraints only the engine can judge (it compiles them): each names the field that gave it.
ENGINE_CASES = [
    ("invalid_json_schema", CHAT, {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ("invalid_guided_json", COMPLETIONS, {"prompt": "Hi", "guided_json": {"type": 12}}, "guided_json"),
    ("invalid_regex", CHAT, {"messages": HI, "guided_regex": "(unclosed"}, "guided_regex"),
    ("invalid_so_regex", COMPLETIONS, {"prompt": "Hi", "structured_outputs": {"regex": "[z-a]"}},
     "structured_outputs"),
    ("invalid_grammar", CHAT, {"messages": HI, "guided_grammar": "root ::= ("}, "guided_grammar"),
    ("grammar_without_root", CHAT, {"messages": HI, "structured_outputs": {"grammar": 'start ::= "x" | '}},
     "structured_outputs"),
]


def check_400(http, path, body, param, stream=False):
    r = http.post(path, json={**body, "max_tokens": 5, "stream": stream})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and param in (err["param"] or "").split(",") + [err["param"]], err
    assert param.split(".")[0] in err["message"] or param.split(",")[0] in err["message"], err


@pytest.mark.parametrize("path,body,param", [c[1:] for c in SERVER_ONLY_CASES], ids=[c[0] for c in SERVER_ONLY_CASES])
def test_bad_constraint_is_a_400(http, path, body, param):
    check_400(http, path, body, param)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("path,body,param", [c[1:] for c in ENGINE_CASES], ids=[c[0] for c in ENGINE_CASES])
def test_invalid_constraint_is_a_400(http, path, body, param, stream):
    check_400(http, path, body, param, stream)


def test_openai_client_sees_the_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=HI, max_tokens=3, response_format={"type": "json_object"},
                                       extra_body={"guided_choice": ["a"]}, **KW)
    assert e.value.body["param"] == "response_format,guided_choice"


def test_text_response_format_and_healthy_after_bad_constraints(client, server):
    text, _ = chat_text(client, messages=HI, max_tokens=5, response_format={"type": "text"})
    assert text
    server.wait_idle()
