"""The model-specific tool parsers (pythonic, mistral, qwen3_coder, granite, deepseek_v3, openai): each on the
text its models emit, whole and streamed at every split point."""

from __future__ import annotations

import json

import pytest

from pagemill.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names
from tests.entrypoints.test_tool_parsers import assert_streams_like_final

WEATHER = {"city": "Paris", "unit": "celsius"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string"}, "days": {"type": "integer"},
    "lat": {"type": "number"}, "metric": {"type": "boolean"}, "tags": {"type": "array"},
    "opts": {"type": "object"}, "zip": {"type": ["string", "null"]}}}}}]

D = {"calls_begin": "<｜tool▁calls▁begin｜>", "calls_end": "<｜tool▁calls▁end｜>",
     "begin": "<｜tool▁call▁begin｜>", "end": "<｜tool▁call▁end｜>", "sep": "<｜tool▁sep｜>"}


def ds_v3(name: str, args: str) -> str:
    return f"{D['begin']}function{D['sep']}{name}\n```json\n{args}\n```{D['end']}"


def ds_v31(name: str, args: str) -> str:
    return f"{D['begin']}{name}{D['sep']}{args}{D['end']}"


QWEN = ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=lat>\n48.85\n</parameter>\n<parameter=metric>\nTrue\n"
        "</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=opts>\n{'x': 1}\n</parameter>\n"
        "<parameter=zip>\nnull\n</parameter>\n<parameter=note>\n  two\nlines <b>  \n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")

CASES = [
    # pythonic (Llama 3.2 / Llama 4 / ToolACE)
    ("pythonic", '[get_weather(city="Paris", unit=\'celsius\')]', "", [("get_weather", WEATHER)]),
    ("pythonic", '<|python_start|>[a(x=1, y=-2.5, z=1e3, s="q\\"uo\\te\\u00e9", b=True, n=None), b()]<|python_end|>',
     "", [("a", {"x": 1, "y": -2.5, "z": 1000.0, "s": "q\"uo\te\u00e9", "b": True, "n": None}), ("b", {})]),
    ("pythonic", "[f(l=[1, (2, 3)], d={'k': {'n': [None]}, \"e\": {}}, t=())]", "",
     [("f", {"l": [1, [2, 3]], "d": {"k": {"n": [None]}, "e": {}}, "t": []})]),
    ("pythonic", "  [ get_time ( ) , mod.fn(a = 'x' ) ]", "", [("get_time", {}), ("mod.fn", {"a": "x"})]),
    ("pythonic", "[Note] this is prose.", "[Note] this is prose.", []),
    ("pythonic", "The weather is nice.", "The weather is nice.", []),
    ("pythonic", "[f(1, 2)]", "[f(1, 2)]", []),
    ("pythonic", '[f(a="cut', "", [("f", '{"a": "cut')]),
    # mistral, v11+ (name[ARGS]{...}), HF rendering without [ARGS], [CALL_ID], and the pre-v11 JSON list
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "Sure.",
     [("get_weather", WEATHER)]),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": [1, 2.5]}[TOOL_CALLS]b[ARGS]{}</s>', "", [("a", {"x": [1, 2.5]}),
                                                                                 ("b", {})]),
    ("mistral", '[TOOL_CALLS]get_weather{"city":"Paris","unit":"celsius"}', "", [("get_weather", WEATHER)]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "unit": "celsius"}', "",
     [("get_weather", WEATHER)]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "b", "arguments": {}}]', "", [("get_weather", WEATHER), ("b", {})]),
    ("mistral", "No tools [here], just [TOOL prose.", "No tools [here], just [TOOL prose.", []),
    ("mistral", "Text [TOOL_CALLS]not a call at all", "Text [TOOL_CALLS]not a call at all", []),
    # qwen3_coder: see test_qwen3_coder_types for the converted values
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
                    "celsius\n</parameter>\n</function>\n</tool_call>", "", [("get_weather", WEATHER)]),
    ("qwen3_coder", "<function=get_weather>\n<parameter=city>\nParis\n<parameter=unit>\ncelsius\n</function>", "",
     [("get_weather", WEATHER)]),
    ("qwen3_coder", "a < b and <tool_c", "a < b and <tool_c", []),
    ("qwen3_coder", "<tool_call>\nnot xml\n</tool_call>", "<tool_call>\nnot xml\n</tool_call>", []),
    # granite 3.0 / 3.1
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', "",
     [("get_weather", WEATHER)]),
    ("granite", ' <tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', "",
     [("a", {"x": 1}), ("b", {})]),
    ("granite", '[{"name": "a", "arguments": {}}]', "", [("a", {})]),
    ("granite", "Paris is sunny.", "Paris is sunny.", []),
    ("granite", "<tool_call>sorry", "<tool_call>sorry", []),
    # deepseek V3 / R1 and V3.1
    ("deepseek_v3", "Checking." + D["calls_begin"] + ds_v3("get_weather", '{"city": "Paris", "unit": "celsius"}')
     + ds_v3("get_time", "{}") + D["calls_end"], "Checking.", [("get_weather", WEATHER), ("get_time", {})]),
    ("deepseek_v3", D["calls_begin"] + ds_v31("get_weather", '{"city":"Paris","unit":"celsius"}') + D["calls_end"],
     "", [("get_weather", WEATHER)]),
    ("deepseek_v31", "x" + D["calls_begin"] + ds_v31("a", '{"n": [1, 2]}') + ds_v31("b", "{}") + D["calls_end"],
     "x", [("a", {"n": [1, 2]}), ("b", {})]),
    ("deepseek_v3", "Just text <｜tool", "Just text <｜tool", []),
    # openai (gpt-oss harmony)
    ("openai", "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
               "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", \"unit\": \"celsius\"}"
               "<|call|>", "", [("get_weather", WEATHER)]),
    ("openai", "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>It is "
               "sunny.<|return|>", "It is sunny.", []),
    ("openai", "<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant to=functions.a"
               "<|channel|>commentary json<|message|>{\"x\": 1}<|call|><|start|>assistant<|channel|>commentary "
               "to=functions.b<|message|>{}<|call|>", "Checking both.", [("a", {"x": 1}), ("b", {})]),
    ("openai", "plain text, no harmony", "plain text, no harmony", []),
]


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parse_and_stream(name, text, content, calls):
    parser = get_tool_parser(name, TOOLS)
    out = parser.parse(text, final=True)
    assert out.content == content
    assert [c.name for c in out.tool_calls] == [n for n, _ in calls]
    for c, (_, args) in zip(out.tool_calls, calls):
        if isinstance(args, str):
            assert c.arguments == args
        else:
            assert json.loads(c.arguments) == args
    assert_streams_like_final(parser, text)


def test_every_prefix_parses_to_a_prefix():
    for name, text, _, _ in CASES + [("qwen3_coder", QWEN, "", [])]:
        parser = get_tool_parser(name, TOOLS)
        prev = parser.parse("", final=False)
        for i in range(1, len(text) + 1):
            cur = parser.parse(text[:i], final=i == len(text))
            assert cur.content.startswith(prev.content), (name, text[:i])
            assert len(cur.tool_calls) >= len(prev.tool_calls), (name, text[:i])
            for a, b in zip(prev.tool_calls, cur.tool_calls):
                assert a.name == b.name and b.arguments.startswith(a.arguments), (name, text[:i])
            prev = cur


def test_qwen3_coder_types():
    """Values converted by the tool schema as vLLM does; unknown parameters stay strings."""
    parser = get_tool_parser("qwen3_coder", TOOLS)
    out = parser.parse(QWEN, final=True)
    assert out.content == "I'll check.\n"
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(out.tool_calls[0].arguments) == {
        "city": "Paris", "days": 3, "lat": 48.85, "metric": True, "tags": ["a", "b"], "opts": {"x": 1},
        "zip": None, "note": "  two\nlines <b>  "}
    assert out.tool_calls[1].arguments == "{}"
    assert_streams_like_final(parser, QWEN)
    bare = get_tool_parser("qwen3_coder")  # no tools: every value is a string
    assert json.loads(bare.parse(QWEN, final=True).tool_calls[0].arguments)["days"] == "3"


def test_streamed_arguments_grow_per_parameter():
    parser = get_tool_parser("qwen3_coder", TOOLS)
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert [(c.name, c.arguments) for c in parser.parse(text, final=False).tool_calls] == [("get_weather", "{")]


def test_registry_and_special_tokens():
    assert {"pythonic", "mistral", "qwen3_coder", "granite", "deepseek_v3", "deepseek_v31", "openai"} <= set(
        tool_parser_names())
    for name in ("mistral", "deepseek_v3", "openai", "granite"):
        assert get_tool_parser(name).keeps_special_tokens
    assert not get_tool_parser("hermes").keeps_special_tokens
