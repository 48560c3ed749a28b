"""Parallel sampling (n > 1, best_of): fan a request out into child sequences and aggregate their outputs."""

from __future__ import annotations

import msgspec

from pagemill.messages import EngineCoreRequest
from pagemill.outputs import CompletionOutput
from pagemill.sampling_params import RequestOutputKind, SamplingParams, wrap_int64


def num_sequences(params: SamplingParams) -> int:
    """Sequences generated for a request: n, or best_of when larger."""
    return max(params.n, params.best_of or 0)


class ParentRequest:
    """A user request with several sequences: its children's ids and their latest outputs, by index."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.n = num_sequences(params)  # sequences generated
        self.num_return = params.n  # best_of: keep only the n most likely sequences
        self.keep_logprobs = params.logprobs is not None  # False when logprobs only rank best_of sequences
        self.child_ids = [f"{i}_{request_id}" for i in range(self.n)]
        self.completions: dict[int, CompletionOutput] = {}
        self.num_finished = 0

    @classmethod
    def from_params(cls, request_id: str, params: SamplingParams) -> ParentRequest | None:
        """The parent of a request with several sequences, else None."""
        return cls(request_id, params) if num_sequences(params) > 1 else None

    def child_requests(self, req: EngineCoreRequest) -> list[EngineCoreRequest]:
        """One engine-core request per sequence; siblings wait for the first one's prefill, then share its blocks."""
        sp = req.sampling_params
        # best_of ranks sequences by cumulative logprob, so the children must compute it.
        logprobs = sp.logprobs if self.n == sp.n or sp.logprobs is not None else 0
        return [msgspec.structs.replace(
            req, request_id=child_id, fork_of=self.child_ids[0] if i else None,
            sampling_params=sp.clone(n=1, best_of=None, logprobs=logprobs, seed=None if sp.seed is None else wrap_int64(sp.seed + i)))
            for i, child_id in enumerate(self.child_ids)]

    @property
    def finished(self) -> bool:
        """True once every child sequence finished."""
        return self.num_finished == self.n

    def add_output(self, completion: CompletionOutput, finished: bool,
                   kind: RequestOutputKind) -> list[CompletionOutput] | None:
        """Fold in one child's output; returns the completions to report now, or None (FINAL_ONLY, not done)."""
        if finished:
            self.num_finished += 1
        if kind != RequestOutputKind.FINAL_ONLY:
            return [completion]
        self.completions[completion.index] = completion
        return self.best() if self.finished else None

    def best(self) -> list[CompletionOutput]:
        """The finished completions in index order, or the best num_return of them by cumulative logprob."""
        outs = [self.completions[i] for i in sorted(self.completions)]
        if self.num_return >= self.n:
            return outs
        outs = sorted(outs, key=lambda c: c.cumulative_logprob, reverse=True)[: self.num_return]
        for i, c in enumerate(outs):
            c.index = i
            if not self.keep_logprobs:
                c.logprobs = c.cumulative_logprob = None
        return outs
