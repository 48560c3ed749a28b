"""IBM Granite 3.2 (`granite`, thinking=True in chat_template_kwargs): "Here is my thought process:" ... "Here is my
response:" (or "Here's ..."), plain text rather than special tokens, so no structured output or budget after it."""

from __future__ import annotations

from pagemill.reasoning.abs_reasoning_parsers import (ReasoningParser, hold_back, may_become,
                                                      register_reasoning_parser)

THOUGHT = ("Here is my thought process:", "Here's my thought process:")
RESPONSE = ("Here is my response:", "Here's my response:")


@register_reasoning_parser("granite")
class GraniteReasoningParser(ReasoningParser):
    """Reasoning after a thought-process marker at the start of the reply, up to the response marker."""

    def split(self, text: str, final: bool, prompt_in_reasoning: bool | None = None) -> tuple[str, str]:
        stripped = text.lstrip()
        skipped = len(text) - len(stripped)
        marker = next((m for m in THOUGHT if stripped.startswith(m)), None)
        if marker is None:
            if not final and may_become(stripped, THOUGHT):
                return "", ""
            return "", text
        rest = text[skipped + len(marker):]
        ends = [(rest.find(m), m) for m in RESPONSE if m in rest]
        if not ends:
            return (rest if final else hold_back(rest, RESPONSE)), ""
        pos, m = min(ends)
        return rest[:pos], rest[pos + len(m):]

    def prompt_in_reasoning(self, prompt: str) -> bool | None:
        return None

    def is_reasoning_end(self, text: str) -> bool:
        return any(m in text for m in RESPONSE)
