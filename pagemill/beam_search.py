"""Beam search over the engine (vLLM's algorithm): every step each live beam asks for its top 2k next tokens.

Beams of one prompt share their KV blocks through the prefix cache; a pruned beam's request ends and
its blocks return to the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagemill.outputs import Logprob


@dataclass
class BeamSearchParams:
    """Beam search settings, named as in vLLM."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt included), per-step logprobs and cumulative logprob."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class BeamSearchInstance:
    """Search state of one prompt."""

    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's beam score: cumulative logprob over length**length_penalty (an ending EOS not counted)."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cum_logprob / (seq_len**length_penalty)
