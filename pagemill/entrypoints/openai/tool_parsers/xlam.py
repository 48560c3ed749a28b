"""xLAM / SmolLM2 style: a JSON list of {"name", "arguments"} objects, bare, in a ```json fence, after
`[TOOL_CALLS]`, or inside `<tool_call>...</tool_call>` (a single object is accepted too)."""

from __future__ import annotations

from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, Prefix, ToolParser, call_from_object,
                                                                calls_from_list, is_nameless, match_literal,
                                                                register_tool_parser, resolve,
                                                                without_marker_start)
from pagemill.entrypoints.openai.tool_parsers.partial_json import JArray, Status, parse_json, skip_ws

MARKERS = ("<tool_call>", "[TOOL_CALLS]", "```")
ARGUMENT_KEYS = ("arguments", "parameters")


@register_tool_parser("xlam")
class XLAMToolParser(ToolParser):
    """Content is the text before the calls (none for a bare list); one list of calls per reply."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = skip_ws(text, 0)
        if first == len(text):
            return ParsedOutput(text if final else "")  # a bare list may still start
        if text[first] in "[{":
            tag = match_literal(text, first, "[TOOL_CALLS]")
            if tag is Prefix.MORE:
                return resolve(text, "", [], False, final)
            if tag is Prefix.NO:
                return self._calls(text, "", first, final)
        found = [(i, m) for m in MARKERS if (i := text.find(m)) >= 0]
        if not found:
            return ParsedOutput(text if final else without_marker_start(text, MARKERS))
        start, marker = min(found)
        pos = start + len(marker)
        if marker == "```":
            fence = match_literal(text, pos, "json")
            if fence is Prefix.MORE:
                return resolve(text, text[:start], [], False, final)
            pos += 4 if fence is Prefix.YES else 0
        return self._calls(text, text[:start], pos, final)

    @staticmethod
    def _calls(text: str, content: str, pos: int, final: bool) -> ParsedOutput:
        result = parse_json(text, pos, final)
        if isinstance(result.node, JArray):
            calls, failed = calls_from_list(result.node, ARGUMENT_KEYS)
        else:
            call = call_from_object(result.node, ARGUMENT_KEYS)
            calls = [call] if call is not None else []
            failed = call is None and is_nameless(result.node, result.status is Status.DONE)
        failed = failed or result.status is Status.ERROR
        return resolve(text, content, calls, failed, final)
