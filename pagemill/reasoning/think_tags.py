"""The `<think>` ... `</think>` parsers: deepseek_r1 (also QwQ; the opening tag may be missing because the
template writes it) and qwen3 (thinking only when the reply, or the prompt, opens a `<think>` block)."""

from __future__ import annotations

from pagemill.reasoning.abs_reasoning_parsers import (ReasoningParser, hold_back, may_become,
                                                      register_reasoning_parser)


class BaseThinkingReasoningParser(ReasoningParser):
    """Thinking between `start_token` and `end_token`; the answer after the end token."""

    start_token = "<think>"
    end_token = "</think>"

    def inside(self, text: str, final: bool) -> tuple[str, str]:
        """The split of a text that starts inside the thinking block."""
        assert self.end_token is not None
        end = text.find(self.end_token)
        if end < 0:
            return (text if final else hold_back(text, (self.end_token,))), ""
        return text[:end], text[end + len(self.end_token):]

    def opening(self, text: str, final: bool) -> tuple[str | None, bool]:
        """(the text after an opening start tag, True) if the reply opens with one; (None, True) while it may
        still; (None, False) when it does not."""
        assert self.start_token is not None
        if text.startswith(self.start_token):
            return text[len(self.start_token):], True
        if not final and may_become(text, (self.start_token,)):
            return None, True
        return None, False


@register_reasoning_parser("deepseek_r1", "kimi_k2")
class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    """vLLM's deepseek_r1: everything before `</think>` is reasoning, with or without the opening `<think>` (R1's
    template writes it into the prompt); a reply without `</think>` is all reasoning. Unless the prompt itself
    closed the thinking (`<think></think>` written by an enable_thinking=False template): then the reply is the
    answer (or a thinking block it opens itself)."""

    def split(self, text: str, final: bool, prompt_in_reasoning: bool | None = None) -> tuple[str, str]:
        rest, opens = self.opening(text, final)
        if rest is None and opens:
            return "", ""
        if rest is None and prompt_in_reasoning is False:
            return "", text
        return self.inside(text if rest is None else rest, final)


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    """vLLM's qwen3: reasoning only inside a `<think>` block the reply opens (or the prompt left open, as the
    thinking-only Qwen3 templates do); with enable_thinking=False the reply is all content."""

    def split(self, text: str, final: bool, prompt_in_reasoning: bool | None = None) -> tuple[str, str]:
        rest, opens = self.opening(text, final)
        if rest is not None:
            return self.inside(rest, final)
        if prompt_in_reasoning:
            return self.inside(text, final)
        if opens:
            return "", ""
        return "", text
