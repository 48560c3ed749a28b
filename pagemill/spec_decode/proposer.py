"""The model-free draft-token proposer protocol and the factory that picks one from a `SpeculativeConfig`."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pagemill.config import SpeculativeConfig


class TokenProposer(Protocol):
    """Proposes draft tokens from a request's own tokens (and, for suffix decoding, earlier requests' outputs)."""

    def propose(self, req_id: str, context: np.ndarray, num_prompt_tokens: int, max_tokens: int) -> list[int]:
        """Up to max_tokens draft tokens to follow `context` (int64 1-D: the request's prompt then its output so far;
        it only ever grows between calls for the same req_id, by one or more tokens)."""
        ...

    def remove_request(self, req_id: str, finished: bool) -> None:
        """Drop the request's state (finished=False: preempted, it may come back with the same context)."""
        ...


def make_token_proposer(config: SpeculativeConfig) -> TokenProposer:
    """The model-free proposer for `config.method` ("ngram" or "suffix"); a ValueError for any other method."""
    if config.method == "ngram":
        from pagemill.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(config)
    if config.method == "suffix":
        from pagemill.spec_decode.suffix_proposer import SuffixProposer

        return SuffixProposer(config)
    raise ValueError(f"speculative method {config.method!r} has no model-free token proposer "
                     "(only 'ngram' and 'suffix').")
