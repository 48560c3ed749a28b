"""A reply split three ways, whole or streamed: reasoning (the --reasoning-parser), then tool calls parsed out of
the answer part only, and the remaining content."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagemill.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser
from pagemill.entrypoints.openai.tool_streaming import ToolCallDelta, ToolCallStreamer
from pagemill.reasoning import ReasoningParser, ReasoningStreamer, get_reasoning_parser


def load_reasoning_parser(name: str | None, tokenizer: Any = None) -> ReasoningParser | None:
    """The parser of --reasoning-parser (None: none)."""
    return get_reasoning_parser(name, tokenizer) if name is not None else None


def prompt_in_reasoning(parser: ReasoningParser | None, tokenizer: Any, prompt_ids: Sequence[int]) -> bool | None:
    """Whether the rendered prompt leaves the reply inside an open thinking block (True), after a closed one
    (False) or neither (None), read from its last tokens."""
    if parser is None or parser.start_token is None:
        return None
    return parser.prompt_in_reasoning(tokenizer.decode(list(prompt_ids[-32:]), skip_special_tokens=False))


@dataclass
class SplitReply:
    """A finished reply: its reasoning (None: none), content, and tool calls."""

    reasoning: str | None
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def split_reply(text: str, reasoning: ReasoningParser | None, in_reasoning: bool | None,
                tools: ToolParser | None) -> SplitReply:
    """The three parts of a whole reply."""
    thought: str | None = None
    if reasoning is not None:
        thought, text = reasoning.split(text, True, in_reasoning)
    if tools is None:
        return SplitReply(thought, text)
    parsed = tools.parse(text, final=True)
    return SplitReply(thought, parsed.content, parsed.tool_calls)


class ReplyStream:
    """One streamed reply: each text delta becomes (reasoning delta, content delta, tool-call pieces)."""

    def __init__(self, reasoning: ReasoningParser | None, in_reasoning: bool | None, tools: ToolParser | None) -> None:
        self.text = ""
        self.reasoning = ReasoningStreamer(reasoning, in_reasoning) if reasoning is not None else None
        self.tools = ToolCallStreamer(tools) if tools is not None else None

    def update(self, delta: str, final: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """What `delta` (the model's new text) adds; `final` once the model has finished."""
        self.text += delta
        if self.reasoning is not None:
            thought, content = self.reasoning.update(self.text, final)
            answer = self.reasoning.content
        else:
            thought, content, answer = "", delta, self.text
        if self.tools is None:
            return thought, content, []
        content, calls = self.tools.update(answer, final)
        return thought, content, calls

    @property
    def has_calls(self) -> bool:
        """Whether any tool call was sent."""
        return self.tools is not None and self.tools.has_calls

    @property
    def call_ids(self) -> list[str]:
        """The ids of the tool calls sent so far."""
        return list(self.tools.ids) if self.tools is not None else []
