"""The DraftProposer protocol the model runner drives: every method's proposer implements it, and the model-free
adapter proposes exactly what its token proposer does, request by request, over rows of a shared token array."""

from __future__ import annotations

import numpy as np
import pytest

from pagemill.config import SpeculativeConfig
from pagemill.spec_decode.draft_model import DraftModelProposer
from pagemill.spec_decode.ngram_proposer import NgramProposer
from pagemill.spec_decode.proposer import DraftProposer, DraftRequests, TokenDraftProposer
from pagemill.spec_decode.select import make_proposer
from pagemill.spec_decode.suffix_proposer import SuffixProposer


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_methods_are_draft_proposers(method):
    proposer = make_proposer(SpeculativeConfig(method=method), runner=None)
    assert isinstance(proposer, TokenDraftProposer)
    assert isinstance(proposer, DraftProposer)
    assert isinstance(proposer.proposer, {"ngram": NgramProposer, "suffix": SuffixProposer}[method])


def test_draft_model_proposer_implements_the_protocol():
    assert issubclass(DraftModelProposer, DraftProposer)
    assert not issubclass(NgramProposer, DraftProposer)  # a TokenProposer proposes per request: it needs the adapter


def test_token_adapter_matches_the_token_proposer_row_by_row():
    config = SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3)
    contexts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6], [9, 9, 9, 9], [4, 8]]
    token_ids = np.zeros((6, 16), dtype=np.int64)
    rows = np.array([4, 0, 2, 5], dtype=np.int64)  # requests sit in arbitrary input-batch rows
    for row, ctx in zip(rows, contexts):
        token_ids[row, :len(ctx)] = ctx
    requests = DraftRequests(["a", "b", "c", "d"], rows, np.array([3, 2, 5, 1], dtype=np.int64),
                             np.array([len(c) for c in contexts], dtype=np.int64),
                             np.array([2, 2, 1, 1], dtype=np.int64), token_ids)
    adapter = TokenDraftProposer(NgramProposer(config))
    adapter.initialize_kv_cache(8)  # model-free: nothing to allocate
    got = adapter.propose(requests)
    reference = NgramProposer(config)
    want = [reference.propose(rid, np.array(ctx, dtype=np.int64), int(npt), int(k))
            for rid, ctx, npt, k in zip(requests.req_ids, contexts, requests.num_prompt_tokens, requests.max_tokens)]
    assert got == want
    assert got[0] == [3, 1, 2] and got[3] == []  # (a repeat to follow; no repeat at all)
    assert all(len(d) <= k for d, k in zip(got, requests.max_tokens))


def test_token_adapter_forwards_remove_request():
    suffix = SuffixProposer(SpeculativeConfig(method="suffix"))
    adapter = TokenDraftProposer(suffix)
    token_ids = np.array([[1, 2, 3, 1, 2, 0, 0, 0]], dtype=np.int64)
    adapter.propose(DraftRequests(["r"], np.array([0]), np.array([2]), np.array([5]), np.array([3]), token_ids))
    assert suffix.has_request("r")
    adapter.remove_request("r", finished=False)
    assert not suffix.has_request("r")
