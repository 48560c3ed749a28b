"""Streamed tool calls: re-parse the whole reply so far at every step and send only what grew."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from pagemill.entrypoints.openai.tool_parsers import ToolParser

logger = logging.getLogger(__name__)


def tool_call_id() -> str:
    """A fresh tool-call id, 'chatcmpl-tool-<hex>' as vLLM names them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    """What one chunk adds to call `index`: the first carries id and name, later ones argument fragments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


class ToolCallStreamer:
    """Turns the growing text of one reply into content and tool-call deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content = ""
        self.ids: list[str] = []
        self.arguments: list[str] = []  # the argument text sent so far, per call

    def update(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """(new content, new call pieces) for the whole reply text so far; `final` once the model has finished."""
        parsed = self.parser.parse(text, final)
        if not parsed.content.startswith(self.content):
            logger.warning("tool parser %s took back streamed content", type(self.parser).__name__)
        content = parsed.content[len(self.content):]
        self.content = parsed.content if len(parsed.content) > len(self.content) else self.content
        deltas: list[ToolCallDelta] = []
        for i, call in enumerate(parsed.tool_calls):
            if i == len(self.ids):
                self.ids.append(tool_call_id())
                self.arguments.append(call.arguments)
                deltas.append(ToolCallDelta(i, call.arguments, self.ids[i], call.name))
                continue
            sent = self.arguments[i]
            if not call.arguments.startswith(sent):
                logger.warning("tool parser %s took back streamed arguments", type(self.parser).__name__)
            if len(call.arguments) > len(sent):
                deltas.append(ToolCallDelta(i, call.arguments[len(sent):]))
                self.arguments[i] = call.arguments
        return content, deltas

    @property
    def has_calls(self) -> bool:
        """Whether any call was sent."""
        return bool(self.ids)
