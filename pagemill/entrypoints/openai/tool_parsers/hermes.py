"""Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""

from __future__ import annotations

from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, ToolParser, read_calls,
                                                                register_tool_parser, resolve, without_marker_start)

START = "<tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


def next_tag(text: str, end: int) -> int:
    """Where the call object of the next `<tool_call>` after `end` starts (-1: none yet)."""
    pos = text.find(START, end)
    return pos + len(START) if pos >= 0 else -1


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """Content is the text before the first `<tool_call>`; each tag holds one call object (text between and after
    the calls is dropped, as vLLM does)."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = text.find(START)
        if start < 0:
            return ParsedOutput(text if final else without_marker_start(text, (START,)))
        calls, failed = read_calls(text, start + len(START), final, ARGUMENT_KEYS, next_tag)
        return resolve(text, text[:start], calls, failed, final)
