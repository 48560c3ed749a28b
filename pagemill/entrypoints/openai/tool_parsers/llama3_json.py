"""Llama 3.x JSON style: `{"name": ..., "parameters": {...}}` objects, optionally after `<|python_tag|>`,
separated by `;`; the reply is tool calls only when it starts with one."""

from __future__ import annotations

from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, ParsedToolCall, Prefix, ToolParser,
                                                                call_from_object, is_nameless, match_literal,
                                                                register_tool_parser, resolve)
from pagemill.entrypoints.openai.tool_parsers.partial_json import Status, parse_json, skip_ws

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


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
        calls: list[ParsedToolCall] = []
        failed = False
        while True:
            result = parse_json(text, pos, final)
            call = call_from_object(result.node, ARGUMENT_KEYS)
            if call is not None:
                calls.append(call)
            else:
                failed = result.status is Status.ERROR or is_nameless(result.node, result.status is Status.DONE)
            if call is None or result.status is not Status.DONE:
                break
            pos = skip_ws(text, result.end)
            if pos == len(text) or text[pos] != ";":
                break
            pos = skip_ws(text, pos + 1)
            if pos == len(text) or text[pos] != "{":
                break
        return resolve(text, "", calls, failed, final)
