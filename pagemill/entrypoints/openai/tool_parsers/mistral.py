"""Mistral: content, then `[TOOL_CALLS]` and the calls, in either of the forms Mistral's tokenizers use:
before v11 a JSON list `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; from v11 one `[TOOL_CALLS]` per call,
`[TOOL_CALLS]name[ARGS]{...}` (older HF renderings drop `[ARGS]`: `name{...}`; v13 may add `[CALL_ID]id`)."""

from __future__ import annotations

import re

from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, ParsedToolCall, Prefix, ToolParser,
                                                                match_literal, register_tool_parser, resolve,
                                                                without_marker_start)
from pagemill.entrypoints.openai.tool_parsers.partial_json import Status, parse_json, skip_ws, to_json
from pagemill.entrypoints.openai.tool_parsers.xlam import XLAMToolParser

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME_END = re.compile(r"\[ARGS\]|\[CALL_ID\]|\{")
_ARGS_START = re.compile(r"\[ARGS\]|\{")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """Content is the text before the first `[TOOL_CALLS]`; text after the last call is dropped."""

    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = text.find(BOT)
        if start < 0:
            return ParsedOutput(text if final else without_marker_start(text, (BOT,)))
        content, pos = text[:start], start + len(BOT)
        first = skip_ws(text, pos)
        if first == len(text):
            return resolve(text, content, [], False, final)
        if text[first] in "[{":  # the pre-v11 JSON list (or one call object)
            return XLAMToolParser._calls(text, content, first, final)
        calls: list[ParsedToolCall] = []
        failed = False
        while True:
            end = _NAME_END.search(text, pos)
            if end is None:
                failed = final or bool(text[pos:].strip()) and not _could_be_name(text[pos:])
                break
            name = text[pos:end.start()].strip()
            if not _NAME.fullmatch(name):
                failed = True
                break
            args = end.end() if end.group() == ARGS else end.start()
            if end.group() == CALL_ID:  # `[CALL_ID]id[ARGS]{...}`: the id is Mistral's own; ours replaces it
                found = _ARGS_START.search(text, end.end())
                if found is None:
                    break
                args = found.end() if found.group() == ARGS else found.start()
            result = parse_json(text, args, final)
            calls.append(ParsedToolCall(name, to_json(result.node)))
            if result.status is not Status.DONE:
                break
            after = skip_ws(text, result.end)
            if match_literal(text, after, BOT) is not Prefix.YES:
                break
            pos = after + len(BOT)
        return resolve(text, content, calls, failed, final)


def _could_be_name(rest: str) -> bool:
    """Whether the text after `[TOOL_CALLS]` can still become `name[ARGS]` (a name, then maybe part of a marker)."""
    stripped = rest.strip()
    bracket = stripped.find("[")
    head = stripped if bracket < 0 else stripped[:bracket]
    tail = "" if bracket < 0 else stripped[bracket:]
    return (not head or bool(_NAME.fullmatch(head))) and (ARGS.startswith(tail) or CALL_ID.startswith(tail))
