"""Beam search over the engine (vLLM's algorithm): every step each live beam asks for its top 2k next tokens.

Beams of one prompt share their KV blocks through the prefix cache; a pruned beam's request ends and
its blocks return to the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagemill.outputs import Logprob
from pagemill.sampling_params import BeamSearchParams, SamplingParams


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


class BeamSearcher:
    """The search over several prompts, one token per step: the caller runs `step_params` for every beam of
    `live()` (one-token requests, any engine) and hands their logprobs to `advance`."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None) -> None:
        self.params, self.eos = params, eos_token_id
        self.instances = [BeamSearchInstance([BeamSearchSequence(list(p), [])]) for p in prompts]
        self.step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1,
                                          temperature=params.temperature)
        self.steps = 0

    def _score(self, b: BeamSearchSequence) -> float:
        return beam_score(b.tokens, b.cum_logprob, self.eos, self.params.length_penalty)

    def live(self) -> list[tuple[int, BeamSearchSequence]]:
        """(prompt index, beam) of every beam still growing; empty when the search is over."""
        if self.steps >= self.params.max_tokens:
            return []
        return [(i, beam) for i, inst in enumerate(self.instances) for beam in inst.beams]

    def advance(self, live: list[tuple[int, BeamSearchSequence]], step_logprobs: list[dict[int, Logprob]]) -> None:
        """Extend each live beam by its candidates (top 2k tokens); keep the best `beam_width` per prompt."""
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.instances]
        for (i, beam), lps in zip(live, step_logprobs):
            for token_id, lp in lps.items():
                new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [lps], beam.cum_logprob + lp.logprob)
                if token_id == self.eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    self.instances[i].completed.append(new)
                else:
                    candidates[i].append(new)
        for inst, cands in zip(self.instances, candidates):
            inst.beams = sorted(cands, key=self._score, reverse=True)[:self.params.beam_width]
        self.steps += 1

    def results(self, decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
        """The `beam_width` best sequences of each prompt, best first, with their text (prompt included)."""
        results = []
        for inst in self.instances:
            for b in inst.beams:
                b.finish_reason = b.finish_reason or "length"
            best = sorted(inst.completed + inst.beams, key=self._score, reverse=True)[:self.params.beam_width]
            for b in best:
                b.text = decode(b.tokens)
            results.append(BeamSearchOutput(best))
        return results
