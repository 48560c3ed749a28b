"""Qwen3-Coder's XML calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; as vLLM does, each is converted by its type in the request's tool schema (string,
integer, number, boolean, object / array as JSON), "null" is null, and a parameter the schema does not know
stays a string. A value ends at `</parameter>` (or, if the model leaves that out, at the next `<parameter=` or
`</function>`); one newline after its tag and one before its end are not part of it. Arguments are streamed
one whole parameter at a time.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, ParsedToolCall, Prefix, ToolParser,
                                                                match_literal, register_tool_parser, resolve,
                                                                without_marker_start)
from pagemill.entrypoints.openai.tool_parsers.partial_json import skip_ws

CALL = "<tool_call>"
CALL_END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"


def convert(value: str, schema: dict | None) -> Any:
    """A parameter's text as the value its schema's type says (vLLM's rules)."""
    if value.lower() == "null":
        return None
    if schema is None:
        return value
    kind = schema.get("type", "string")
    kind = str(next((k for k in kind if k != "null"), "string") if isinstance(kind, list) else kind).lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float", "double")):
            number = float(value)
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
    except ValueError:
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return value


@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    """Content is the text before the first `<tool_call>` (or bare `<function=`); text after the calls is dropped."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        found = [i for m in (CALL, FUNCTION) if (i := text.find(m)) >= 0]
        if not found:
            return ParsedOutput(text if final else without_marker_start(text, (CALL, FUNCTION)))
        start = min(found)
        calls: list[ParsedToolCall] = []
        pos, failed = start, False
        while True:
            pos = skip_ws(text, pos)
            tag = match_literal(text, pos, CALL)
            if tag is Prefix.MORE:
                break
            if tag is Prefix.YES:
                pos = skip_ws(text, pos + len(CALL))
            fn = match_literal(text, pos, FUNCTION)
            if fn is not Prefix.YES:
                failed = fn is Prefix.NO and not calls and pos < len(text)
                break
            close = text.find(">", pos)
            if close < 0:
                break
            name = text[pos + len(FUNCTION):close].strip()
            if not name or "<" in name or "\n" in name:
                failed = not calls
                break
            call = ParsedToolCall(name, "{")
            calls.append(call)
            pos, members, closed = self._parameters(text, close + 1, name)
            call.arguments = "{" + ", ".join(members) + ("}" if closed else "")
            if not closed:
                break
            pos = skip_ws(text, pos)
            if match_literal(text, pos, CALL_END) is Prefix.YES:
                pos += len(CALL_END)
            nxt = skip_ws(text, pos)
            if not (text.startswith(CALL, nxt) or text.startswith(FUNCTION, nxt)):
                break
            pos = nxt
        return resolve(text, text[:start], calls, failed, final)

    def _parameters(self, text: str, pos: int, function: str) -> tuple[int, list[str], bool]:
        """The complete `"key": value` members of one function's parameters from `pos`, where reading stopped,
        and whether `</function>` closed them."""
        members: list[str] = []
        while True:
            pos = skip_ws(text, pos)
            if match_literal(text, pos, FUNCTION_END) is Prefix.YES:
                return pos + len(FUNCTION_END), members, True
            if match_literal(text, pos, PARAMETER) is not Prefix.YES:
                return pos, members, False
            close = text.find(">", pos)
            if close < 0:
                return pos, members, False
            key = text[pos + len(PARAMETER):close].strip()
            ends = [(i, m) for m in (PARAMETER_END, PARAMETER, FUNCTION_END) if (i := text.find(m, close + 1)) >= 0]
            if not ends:
                return pos, members, False
            end, marker = min(ends)
            value = text[close + 1:end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            converted = convert(value, self.parameter_schema(function, key))
            members.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(converted, ensure_ascii=False)}")
            pos = end + len(PARAMETER_END) if marker == PARAMETER_END else end
