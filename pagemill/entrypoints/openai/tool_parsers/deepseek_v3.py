"""DeepSeek V3 / R1 and V3.1: content, then the calls between `<｜tool▁calls▁begin｜>` and
`<｜tool▁calls▁end｜>`.

V3 / R1:  <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
V3.1:     <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
Both parsers read both forms (after the separator, `{` means V3.1's, anything else V3's).
"""

from __future__ import annotations

from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, ParsedToolCall, Prefix, ToolParser,
                                                                match_literal, register_tool_parser, resolve,
                                                                without_marker_start)
from pagemill.entrypoints.openai.tool_parsers.partial_json import Status, parse_json, skip_ws, to_json

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```json"


@register_tool_parser("deepseek_v3")
class DeepSeekV3ToolParser(ToolParser):
    """Content is the text before the calls; text after the last call is dropped."""

    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        found = [i for m in (CALLS_BEGIN, CALL_BEGIN) if (i := text.find(m)) >= 0]
        if not found:
            return ParsedOutput(text if final else without_marker_start(text, (CALLS_BEGIN, CALL_BEGIN)))
        start = min(found)
        content = text[:start]
        pos = start + len(CALLS_BEGIN) if text.startswith(CALLS_BEGIN, start) else start
        calls: list[ParsedToolCall] = []
        failed = False
        while True:
            pos = skip_ws(text, pos)
            begin = match_literal(text, pos, CALL_BEGIN)
            if begin is not Prefix.YES:
                failed = begin is Prefix.NO and not calls and match_literal(text, pos, CALLS_END) is Prefix.NO
                break
            pos += len(CALL_BEGIN)
            sep = text.find(SEP, pos)
            if sep < 0:
                break
            head, pos = text[pos:sep].strip(), skip_ws(text, sep + len(SEP))
            if pos == len(text):
                break
            if text[pos] in "{[":  # V3.1: the name before the separator
                name = head
            else:  # V3: the type before the separator, the name on its own line
                eol = text.find("\n", pos)
                if eol < 0:
                    break
                name, pos = text[pos:eol].strip(), skip_ws(text, eol + 1)
                fence = match_literal(text, pos, FENCE)
                if fence is Prefix.MORE:
                    break
                if fence is Prefix.YES:
                    pos += len(FENCE)
            if not name:
                failed = not calls
                break
            result = parse_json(text, pos, final)
            if result.node is None and result.status is Status.ERROR:
                failed = not calls
                break
            calls.append(ParsedToolCall(name, to_json(result.node)))
            if result.status is not Status.DONE:
                break
            end = text.find(CALL_END, result.end)
            if end < 0:
                break
            pos = end + len(CALL_END)
        return resolve(text, content, calls, failed, final)


@register_tool_parser("deepseek_v31")
class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """DeepSeek V3.1's name for the same parser (it reads both forms)."""
