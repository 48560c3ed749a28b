"""The reasoning-parser interface and its registry.

A parser maps the model's whole text so far to (reasoning, content). Its one rule, as the tool parsers': for a
text and any continuation of it, `split(text, final=False)` gives a prefix of what `split(longer, ...)` gives,
field by field (text that may still turn out to be a marker is held back). Streaming re-splits the whole text at
every step and sends only the growth, so the streamed deltas of any chunking add up to the non-streamed split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

_PARSERS: dict[str, type["ReasoningParser"]] = {}


@dataclass
class ReasoningDelta:
    """What one streamed chunk adds: reasoning text, answer text (None where nothing)."""

    reasoning: str | None = None
    content: str | None = None


def hold_back(text: str, markers: Iterable[str]) -> str:
    """`text` less its longest ending that could be the start of one of `markers` (held back while streaming)."""
    keep = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                keep = min(keep, len(text) - k)
                break
    return text[:keep]


def may_become(text: str, markers: Iterable[str]) -> bool:
    """True when `text` is a proper prefix of one of `markers` (it may still become that marker)."""
    return any(len(text) < len(m) and m.startswith(text) for m in markers)


class ReasoningParser(ABC):
    """Splits a reasoning model's reply. `start_token` / `end_token`: the markers (special tokens for the think-tag
    parsers), which the engine core also uses for structured output and the thinking budget (None: no token-level
    support, as vLLM's granite)."""

    name: ClassVar[str] = ""
    start_token: ClassVar[str | None] = None
    end_token: ClassVar[str | None] = None

    def __init__(self, tokenizer: Any = None) -> None:
        self.model_tokenizer = tokenizer

    @abstractmethod
    def split(self, text: str, final: bool, prompt_in_reasoning: bool | None = None) -> tuple[str, str]:
        """(reasoning, content) of the text so far; `final` once the model has finished. `prompt_in_reasoning`:
        True when the prompt left the reply inside an open thinking block (a template that opens `<think>`
        itself), False when the prompt closed one at its end (enable_thinking=False templates), None when the
        prompt has neither marker."""

    def prompt_in_reasoning(self, prompt: str) -> bool | None:
        """Whether the rendered prompt ends inside an open thinking block (its last start marker is after its last
        end marker: True), after a closed one (False), or has neither marker (None)."""
        if self.start_token is None or self.end_token is None:
            return None
        start, end = prompt.rfind(self.start_token), prompt.rfind(self.end_token)
        return None if start < 0 and end < 0 else start > end

    # ---- vLLM's interface ----
    def extract_reasoning(self, model_output: str, request: Any = None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply, None for an empty part."""
        reasoning, content = self.split(model_output, True)
        return reasoning or None, content or None

    extract_reasoning_content = extract_reasoning  # vLLM's older name

    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
                                    delta_token_ids: Sequence[int] = (), final: bool = False
                                    ) -> ReasoningDelta | None:
        """What `delta_text` adds (given the text before it); None when it adds nothing yet (held back)."""
        old_r, old_c = self.split(previous_text, False)
        new_r, new_c = self.split(current_text, final)
        delta = ReasoningDelta(new_r[len(old_r):] or None, new_c[len(old_c):] or None)
        return delta if delta.reasoning is not None or delta.content is not None else None

    def is_reasoning_end(self, text: str) -> bool:
        """Whether the thinking of `text` (a reply so far) has ended: its content has begun."""
        return self.end_token is not None and self.end_token in text


class ReasoningStreamer:
    """Turns the growing text of one reply into reasoning and content deltas (and keeps the totals)."""

    def __init__(self, parser: ReasoningParser, prompt_in_reasoning: bool | None = None) -> None:
        self.parser = parser
        self.prompt_in_reasoning = prompt_in_reasoning
        self.reasoning = ""
        self.content = ""

    def update(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content) for the whole reply text so far."""
        reasoning, content = self.parser.split(text, final, self.prompt_in_reasoning)
        dr = reasoning[len(self.reasoning):] if reasoning.startswith(self.reasoning) else ""
        dc = content[len(self.content):] if content.startswith(self.content) else ""
        self.reasoning = reasoning if len(reasoning) > len(self.reasoning) else self.reasoning
        self.content = content if len(content) > len(self.content) else self.content
        return dr, dc


def register_reasoning_parser(*names: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    """Class decorator: make a parser selectable as `--reasoning-parser NAME` (under each of `names`)."""

    def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        cls.name = names[0]
        for n in names:
            _PARSERS[n] = cls
        return cls

    return register


def reasoning_parser_names() -> list[str]:
    """The names `--reasoning-parser` accepts."""
    return sorted(_PARSERS)


def get_reasoning_parser(name: str, tokenizer: Any = None) -> ReasoningParser:
    """A parser by name; ValueError naming reasoning_parser for an unknown one."""
    if name not in _PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(sorted(_PARSERS))}, got {name!r}.")
    return _PARSERS[name](tokenizer)


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The class registered under `name` (ValueError as get_reasoning_parser)."""
    if name not in _PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(sorted(_PARSERS))}, got {name!r}.")
    return _PARSERS[name]
