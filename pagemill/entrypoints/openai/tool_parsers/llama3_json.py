"""Llama 3.x JSON style: `{"name": ..., "parameters": {...}}` objects, optionally after `<|python_tag|>`,
separated by `;`; the reply is tool calls only when it starts with one."""

from __future__ import annotations

from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, Prefix, ToolParser, match_literal,
                                                                read_calls, register_tool_parser, resolve)
from pagemill.entrypoints.openai.tool_parsers.partial_json import skip_ws

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


def next_after_semicolon(text: str, end: int) -> int:
    """Where the next `;`-separated call object starts after one ending at `end` (-1: none)."""
    pos = skip_ws(text, end)
    if pos == len(text) or text[pos] != ";":
        return -1
    pos = skip_ws(text, pos + 1)
    return pos if pos < len(text) and text[pos] == "{" else -1


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """No content beside the calls; text after the last call is dropped."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pos = skip_ws(text, 0)
        if pos == len(text):
            return resolve(text, "", [], False, final)
        tag = match_literal(text, pos, PYTHON_TAG)
        if tag is Prefix.MORE:
            return resolve(text, "", [], False, final)
        if tag is Prefix.YES:
            pos += len(PYTHON_TAG)
        elif text[pos] != "{":
            return ParsedOutput(text)
        calls, failed = read_calls(text, pos, final, ARGUMENT_KEYS, next_after_semicolon)
        return resolve(text, "", calls, failed, final)
