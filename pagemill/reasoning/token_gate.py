"""The reasoning state of one request in the engine core, token by token: whether the thinking has ended (a
structured-output grammar applies only after it) and, with a thinking budget, which end-marker token to force once
the budget is spent (vLLM's `thinking_token_budget`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def _last_index(haystack: Sequence[int], needle: Sequence[int]) -> int:
    """Where the last occurrence of `needle` in `haystack` starts (-1: none)."""
    n = len(needle)
    if not n:
        return -1
    first = needle[0]
    for i in range(len(haystack) - n, -1, -1):
        if haystack[i] == first and list(haystack[i:i + n]) == list(needle):
            return i
    return -1


@dataclass(frozen=True)
class ReasoningTokens:
    """A parser's start / end markers as token ids (the end marker can be a longer phrase that ends in it:
    vLLM's `reasoning_end_str`)."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

    @classmethod
    def from_strings(cls, tokenizer: Any, start: str, end: str) -> "ReasoningTokens":
        """The markers tokenized without special tokens; ValueError if one is empty."""
        start_ids = tuple(tokenizer.encode(start, add_special_tokens=False))
        end_ids = tuple(tokenizer.encode(end, add_special_tokens=False))
        if not start_ids or not end_ids:
            raise ValueError("reasoning_config: the reasoning start and end strings must not be empty.")
        return cls(start_ids, end_ids)

    def ended_in(self, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids` (a prompt) ends with its thinking closed: its last end marker is after its last start
        marker. Neither marker: not ended (vLLM's rule: the reply starts thinking)."""
        return _last_index(token_ids, self.end_ids) > _last_index(token_ids, self.start_ids)


class ReasoningGate:
    """Follows a request's output tokens through its thinking."""

    def __init__(self, tokens: ReasoningTokens, budget: int | None, prompt_token_ids: Sequence[int]) -> None:
        self.tokens = tokens
        self.budget = budget
        self.ended = tokens.ended_in(prompt_token_ids)
        self.num_reasoning_tokens = 0
        self._recent: list[int] = []  # the last tokens, long enough to see either marker

    def accept(self, token: int) -> bool:
        """Follow one output token; True if it belongs to the thinking (the end marker included), False once the
        thinking has ended (the token is the answer's)."""
        if self.ended:
            return False
        t = self.tokens
        self._recent.append(token)
        keep = max(len(t.start_ids), len(t.end_ids))
        if len(self._recent) > keep:
            del self._recent[:-keep]
        self.num_reasoning_tokens += 1
        if tuple(self._recent[-len(t.end_ids):]) == t.end_ids:
            self.ended = True
        elif tuple(self._recent[-len(t.start_ids):]) == t.start_ids:
            self.num_reasoning_tokens = 0  # the budget counts from the opening marker
        return True

    def forced_token(self) -> int | None:
        """The token the next step must sample (the next one of the end marker) once the budget is spent; None
        while the model may think on (or has stopped thinking)."""
        if self.ended or self.budget is None or self.num_reasoning_tokens < self.budget:
            return None
        end = self.tokens.end_ids
        for k in range(min(len(end) - 1, len(self._recent)), 0, -1):  # the end marker begun already
            if tuple(self._recent[-k:]) == end[:k]:
                return end[k]
        return end[0]
