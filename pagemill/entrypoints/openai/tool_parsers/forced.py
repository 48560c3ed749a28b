"""Parsers for replies whose shape a forced tool_choice constrains: a named function's arguments, or the JSON list
of `tool_choice="required"`; and the one-call limit of `parallel_tool_calls=false`."""

from __future__ import annotations

from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, ParsedToolCall, ToolParser,
                                                                calls_from_list, resolve)
from pagemill.entrypoints.openai.tool_parsers.partial_json import JArray, Status, parse_json, to_json

REQUIRED_ARGUMENT_KEYS = ("parameters", "arguments")


class NamedFunctionParser(ToolParser):
    """`tool_choice={"type": "function", ...}`: the whole reply is the arguments of that one function."""

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", [ParsedToolCall(self.function_name, to_json(parse_json(text, 0, final).node))])


class RequiredToolsParser(ToolParser):
    """`tool_choice="required"`: the reply is a JSON list of {"name", "parameters"} objects."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        result = parse_json(text, 0, final)
        if not isinstance(result.node, JArray):
            return resolve(text, "", [], result.node is not None or result.status is Status.ERROR, final)
        calls, failed = calls_from_list(result.node, REQUIRED_ARGUMENT_KEYS)
        return resolve(text, "", calls, failed or result.status is Status.ERROR, final)


class AtMostOneCall(ToolParser):
    """Keeps only the first call another parser finds (`parallel_tool_calls=false`)."""

    def __init__(self, inner: ToolParser) -> None:
        self.inner = inner

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out = self.inner.parse(text, final)
        out.tool_calls = out.tool_calls[:1]
        return out
