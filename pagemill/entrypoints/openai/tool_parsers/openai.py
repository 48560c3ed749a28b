"""gpt-oss's harmony format (`--tool-call-parser openai`): the reply is a sequence of messages,

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

A message addressed `to=functions.NAME` (in its header, before or after the channel) is a call whose body is the
JSON arguments; the bodies of `final` messages, and of `commentary` messages addressed to no one (preambles), are
the content; `analysis` is the model's reasoning and is left out. A reply that is not in this format is content.
"""

from __future__ import annotations

import re

from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, ParsedToolCall, Prefix, ToolParser,
                                                                match_literal, register_tool_parser,
                                                                without_marker_start)
from pagemill.entrypoints.openai.tool_parsers.partial_json import parse_json, skip_ws, to_json

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
CONTENT_CHANNELS = ("final", "commentary")


@register_tool_parser("openai")
class OpenAIToolParser(ToolParser):
    """Messages are read in order; one that is still being written contributes what it has so far."""

    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pos = skip_ws(text, 0)
        if pos == len(text):
            return ParsedOutput(text if final else "")
        if all(match_literal(text, pos, m) is Prefix.NO for m in (START, CHANNEL)):
            return ParsedOutput(text if final else without_marker_start(text, ENDS))
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        while pos < len(text):
            body = text.find(MESSAGE, pos)
            if body < 0:
                break
            header, body = text[pos:body], body + len(MESSAGE)
            ends = [(i, m) for m in ENDS if (i := text.find(m, body)) >= 0]
            end, marker = min(ends) if ends else (len(text), "")
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            if recipient is not None and recipient.group(1).startswith("functions."):
                name = recipient.group(1)[len("functions."):]
                calls.append(ParsedToolCall(name, to_json(parse_json(text[body:end], 0, final or bool(marker)).node)))
            elif recipient is None and channel is not None and channel.group(1) in CONTENT_CHANNELS:
                part = text[body:end]
                content.append(part if marker or final else without_marker_start(part, ENDS))
            if not marker:
                break
            pos = skip_ws(text, end + len(marker))
        return ParsedOutput("".join(content), calls)
