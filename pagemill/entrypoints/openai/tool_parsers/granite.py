"""IBM Granite 3.x: the reply is `<|tool_call|>` (3.0) or `<tool_call>` (3.1) followed by a JSON list of
{"name", "arguments"} objects; a reply that does not start so is content."""

from __future__ import annotations

from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, Prefix, ToolParser, match_literal,
                                                                register_tool_parser, resolve)
from pagemill.entrypoints.openai.tool_parsers.partial_json import skip_ws
from pagemill.entrypoints.openai.tool_parsers.xlam import XLAMToolParser

TAGS = ("<|tool_call|>", "<tool_call>")


@register_tool_parser("granite")
class GraniteToolParser(ToolParser):
    """No content beside the calls (as vLLM's granite parser); text after the list is dropped."""

    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pos = skip_ws(text, 0)
        if pos == len(text):
            return resolve(text, "", [], False, final)
        seen = [match_literal(text, pos, tag) for tag in TAGS]
        if Prefix.YES in seen:
            pos = skip_ws(text, pos + len(TAGS[seen.index(Prefix.YES)]))
            if pos == len(text):
                return resolve(text, "", [], False, final)
        elif Prefix.MORE in seen:
            return resolve(text, "", [], False, final)
        if text[pos] not in "[{":
            return ParsedOutput(text)
        return XLAMToolParser._calls(text, "", pos, final)
