"""Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""

from __future__ import annotations

from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, ParsedToolCall, ToolParser,
                                                                call_from_object, is_nameless,
                                                                register_tool_parser, resolve,
                                                                without_marker_start)
from pagemill.entrypoints.openai.tool_parsers.partial_json import Status, parse_json

START = "<tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """Content is the text before the first `<tool_call>`; each tag holds one call object (text between and after
    the calls is dropped, as vLLM does)."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = text.find(START)
        if start < 0:
            return ParsedOutput(text if final else without_marker_start(text, (START,)))
        calls: list[ParsedToolCall] = []
        failed, pos = False, start
        while True:
            result = parse_json(text, pos + len(START), final)
            call = call_from_object(result.node, ARGUMENT_KEYS)
            if call is not None:
                calls.append(call)
            else:
                failed = result.status is Status.ERROR or is_nameless(result.node, result.status is Status.DONE)
            if call is None or result.status is not Status.DONE:
                break
            pos = text.find(START, result.end)
            if pos < 0:
                break
        return resolve(text, text[:start], calls, failed, final)
