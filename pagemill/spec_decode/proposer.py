"""The draft-token proposer protocols: `DraftProposer` (what the model runner calls, once per step for the whole
batch) and `TokenProposer` (a model-free proposer working on one request's tokens), with the adapter that makes a
TokenProposer a DraftProposer and the factory that picks a model-free one from a `SpeculativeConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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


@dataclass(frozen=True)
class DraftRequests:
    """The requests that want draft tokens this step, as rows of the runner's input batch (numpy, one entry each)."""

    req_ids: list[str]
    rows: np.ndarray  # int64: input-batch rows
    max_tokens: np.ndarray  # int64: most draft tokens each may get (>= 1: within max_tokens and the context length)
    num_tokens: np.ndarray  # int64: tokens so far (prompt then output)
    num_prompt_tokens: np.ndarray  # int64
    token_ids: np.ndarray  # the input batch's whole token-id array [rows, max_model_len] (a view: drafts may be
    #                        written past a request's tokens as scratch space)

    def context(self, i: int) -> np.ndarray:
        """Request i's tokens (prompt then output so far), a view into the input batch."""
        return self.token_ids[self.rows[i], :self.num_tokens[i]]


@runtime_checkable
class DraftProposer(Protocol):
    """What the model runner drives: a proposer of draft tokens for a batch of requests (n-gram, suffix tree,
    draft model), with the KV cache it may need and per-request state it must drop."""

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate what the proposer keeps per KV block (a draft model's KV tensors, indexed by the target's block
        ids); model-free proposers keep nothing."""
        ...

    def propose(self, requests: DraftRequests) -> list[list[int]]:
        """Up to requests.max_tokens[i] draft tokens for each request, in order."""
        ...

    def remove_request(self, req_id: str, finished: bool) -> None:
        """Drop the request's state (finished=False: preempted, it may come back with the same context)."""
        ...


class TokenDraftProposer:
    """A DraftProposer made of a model-free TokenProposer: each request's drafts from its own tokens."""

    def __init__(self, proposer: TokenProposer) -> None:
        self.proposer = proposer

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Nothing: a model-free proposer keeps no KV."""

    def propose(self, requests: DraftRequests) -> list[list[int]]:
        """The token proposer's drafts, request by request."""
        return [self.proposer.propose(rid, requests.context(i), int(requests.num_prompt_tokens[i]),
                                      int(requests.max_tokens[i])) for i, rid in enumerate(requests.req_ids)]

    def remove_request(self, req_id: str, finished: bool) -> None:
        """Forward to the token proposer."""
        self.proposer.remove_request(req_id, finished)


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
