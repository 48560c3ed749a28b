"""Tool-call parsers and their streaming: every split of a model's text streams exactly the non-streamed result."""

from __future__ import annotations

import json
import random
import re

import pytest

from pagemill.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser, tool_parser_names
from pagemill.entrypoints.openai.tool_parsers.forced import AtMostOneCall, NamedFunctionParser, RequiredToolsParser
from pagemill.entrypoints.openai.tool_parsers.partial_json import Status, parse_json, to_json
from pagemill.entrypoints.openai.tool_streaming import ToolCallStreamer

WEATHER = {"city": "Paris", "unit": "celsius"}
TRICKY = {"q": "a \"quoted\" \\ back/slash\nnew line", "e": "caf\u00e9 \U0001F600", "n": [0, -1.5, 2e10, 1E-3],
          "b": [True, False, None], "o": {"nested": {"deep": []}, "empty": {}}}
TRICKY_TEXT = ('{"q": "a \\"quoted\\" \\\\ back\\/slash\\nnew line", "e": "caf\\u00e9 \\ud83d\\ude00", '
               '"n": [0, -1.5, 2e10, 1E-3], "b": [true, false, null], "o": {"nested": {"deep": []}, "empty": {}}}')


def canonical(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


# (parser name, model text, expected content, expected [(name, arguments as a Python value or a raw string)])
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>', "Let me check.\n", [("get_weather", WEATHER)]),
    ("hermes", '<tool_call>{"name":"a","arguments":' + TRICKY_TEXT + '}</tool_call>\n<tool_call>\n'
               '{"arguments": {"x": 1}, "name": "b"}\n</tool_call>', "", [("a", TRICKY), ("b", {"x": 1})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", {"a": 1})]),
    ("hermes", '<tool_call>{"name": "noargs"}</tool_call>', "", [("noargs", {})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 12', "", [("f", '{"a": 12')]),  # cut by max_tokens
    ("hermes", "Hello <tool world, 1 < 2 and <tool_call", "Hello <tool world, 1 < 2 and <tool_call", []),
    ("hermes", "Hi <tool_call>not json</tool_call>", "Hi <tool_call>not json</tool_call>", []),
    ("hermes", '<tool_call>{"foo": 1}</tool_call>', '<tool_call>{"foo": 1}</tool_call>', []),
    ("hermes", '<tool_call>{"name": 5}</tool_call>', '<tool_call>{"name": 5}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>oops',
     "", [("f", {})]),
    ("xlam", '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', "",
     [("a", {"x": 1}), ("b", {})]),
    ("xlam", '  \n[{"name": "a", "arguments": ' + TRICKY_TEXT + '}]', "", [("a", TRICKY)]),
    ("xlam", 'Sure.\n```json\n[{"name": "a", "arguments": {"x": [1, 2.5e3, true, null]}}]\n```', "Sure.\n",
     [("a", {"x": [1, 2.5e3, True, None]})]),
    ("xlam", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]</tool_call>',
     "", [("get_weather", WEATHER)]),
    ("xlam", '[TOOL_CALLS][{"name": "f", "arguments": {"a": "b"}}]', "", [("f", {"a": "b"})]),
    ("xlam", '```\n{"name": "f", "arguments": {"a": "b"}}\n```', "", [("f", {"a": "b"})]),
    ("xlam", "Here:\n```python\nprint(1)\n```", "Here:\n```python\nprint(1)\n```", []),
    ("xlam", "[1] is a citation.", "[1] is a citation.", []),
    ("xlam", "[", "[", []),
    ("xlam", "Plain prose, no calls at all.", "Plain prose, no calls at all.", []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "",
     [("f", {"a": 1}), ("g", {})]),
    ("llama3_json", ' {"name": "f", "arguments": ' + TRICKY_TEXT + '} trailing', "", [("f", TRICKY)]),
    ("llama3_json", "Hello {", "Hello {", []),
    ("llama3_json", '{"foo": 1}', '{"foo": 1}', []),
]


def stream(parser: ToolParser, chunks: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Feed the chunks through a ToolCallStreamer; (content, [(name, arguments)], ids) from the deltas alone."""
    streamer = ToolCallStreamer(parser)
    text, content, calls = "", "", []
    for k, chunk in enumerate(chunks):
        text += chunk
        piece, deltas = streamer.update(text, final=k == len(chunks) - 1)
        content += piece
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls) and d.name
                calls.append([d.id, d.name, d.arguments])
            else:
                assert d.name is None and d.arguments and d.index < len(calls)
                calls[d.index][2] += d.arguments
    ids = [c[0] for c in calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("chatcmpl-tool-") for i in ids)
    return content, [(name, args) for _, name, args in calls], ids


def assert_streams_like_final(parser: ToolParser, text: str) -> None:
    final = parser.parse(text, final=True)
    want = (final.content, [(c.name, c.arguments) for c in final.tool_calls])
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits += [list(text), list(text) + [""]]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for chunks in splits:
        content, calls, _ = stream(parser, chunks)
        assert (content, calls) == want, chunks


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parse_and_stream(name, text, content, calls):
    parser = get_tool_parser(name)
    out = parser.parse(text, final=True)
    assert out.content == content
    assert [c.name for c in out.tool_calls] == [name for name, _ in calls]
    for c, (_, args) in zip(out.tool_calls, calls):
        if isinstance(args, str):
            assert c.arguments == args
        else:  # canonical spacing; numbers stay as the model wrote them
            assert json.loads(c.arguments) == args
            assert c.arguments == canonical(args) or "e" in c.arguments.replace("true", "")
    assert_streams_like_final(parser, text)


def test_every_prefix_parses_to_a_prefix():
    """The parser rule itself, checked between consecutive prefixes (so between any two, by transitivity)."""
    for name, text, _, _ in CASES:
        parser = get_tool_parser(name)
        prev = parser.parse("", final=False)
        for i in range(1, len(text) + 1):
            cur = parser.parse(text[:i], final=i == len(text))
            assert cur.content.startswith(prev.content), (name, text[:i])
            assert len(cur.tool_calls) >= len(prev.tool_calls), (name, text[:i])
            for a, b in zip(prev.tool_calls, cur.tool_calls):
                assert a.name == b.name and b.arguments.startswith(a.arguments), (name, text[:i])
            prev = cur


def test_registry():
    assert {"hermes", "xlam", "llama3_json"} <= set(tool_parser_names())
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")


def test_named_function_parser():
    parser = NamedFunctionParser("get_weather")
    out = parser.parse('  {"city" :"Paris",\n "unit": "celsius" }', final=True)
    assert out.content == "" and [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", canonical(WEATHER))]
    assert_streams_like_final(parser, '{"city": "Paris", "n": [1, 2.0, -3e2], "s": "\\u00e9"}')


def test_required_parser_and_one_call_limit():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": "z"}}]'
    out = RequiredToolsParser().parse(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("a", {"x": 1}), ("b", {"y": "z"})]
    assert_streams_like_final(RequiredToolsParser(), text)
    assert RequiredToolsParser().parse("not a list", final=True).content == "not a list"
    one = AtMostOneCall(get_tool_parser("hermes"))
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c.name for c in one.parse(two, final=True).tool_calls] == ["a"]
    assert_streams_like_final(one, two)


@pytest.mark.parametrize("text", [
    TRICKY_TEXT, "[]", "{}", '"x"', "-0.5e+3", "true", '[1, [2, [3, {"a": [null]}]], "\\u0041"]',
    '{"k": "\\ud83d"}', '{"lone": "\\udc00x"}'])
def test_partial_json_prefixes(text):
    full = parse_json(text, 0, final=True)
    assert full.status is Status.DONE and full.end == len(text)
    final_text = to_json(full.node)
    lone_surrogates_replaced = re.sub("[\ud800-\udfff]", "\ufffd", json.dumps(json.loads(text), ensure_ascii=False))
    assert json.loads(final_text) == json.loads(lone_surrogates_replaced)
    prev = ""
    for i in range(len(text) + 1):
        cur = to_json(parse_json(text[:i], 0, final=False).node)
        assert cur.startswith(prev) and final_text.startswith(cur), text[:i]
        prev = cur


def test_partial_json_errors_stop_reading():
    assert parse_json('{"a": 1,}', 0, True).status is Status.ERROR
    assert parse_json('{"a" 1}', 0, True).status is Status.ERROR
    assert parse_json("[1 2]", 0, True).status is Status.ERROR
    assert parse_json('"bad \\x escape"', 0, True).status is Status.ERROR
    assert parse_json("nul", 0, False).status is Status.MORE
    assert parse_json("nulx", 0, False).status is Status.ERROR
    r = parse_json('{"a": [1, 2', 0, False)
    assert r.status is Status.MORE and to_json(r.node) == '{"a": [1'  # 2 may still grow
    assert to_json(parse_json('{"a": [1, 2', 0, True).node) == '{"a": [1, 2'
