"""NgramProposer (prompt lookup): exact proposals on hand-built contexts and against a brute-force reference."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagemill.config import SpeculativeConfig
from pagemill.spec_decode.ngram_proposer import NgramProposer
from pagemill.spec_decode.proposer import make_token_proposer
from pagemill.spec_decode.suffix_proposer import SuffixProposer


def _propose(tokens: list[int], k: int, lo: int = 2, hi: int = 5) -> list[int]:
    p = NgramProposer(SpeculativeConfig(method="ngram", prompt_lookup_min=lo, prompt_lookup_max=hi))
    return p.propose("r", np.array(tokens, dtype=np.int64), 1, k)


def _reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Brute force: longest n in [lo, hi], then the most recent earlier start (overlap allowed) followed by k
    tokens, else the earliest start."""
    n = len(tokens)
    if k <= 0:
        return []
    for size in range(min(hi, n - 1), lo - 1, -1):
        suffix = tokens[n - size:]
        starts = [s for s in range(n - size) if tokens[s:s + size] == suffix]
        if starts:
            full = [s for s in starts if s + size + k <= n]
            start = full[-1] if full else starts[0]
            return tokens[start + size:start + size + k]
    return []


def test_longest_ngram_wins():
    # [2, 3, 4] occurs at the start (then 5, 6); the more recent [3, 4] (then 7) is shorter.
    ctx = [1, 2, 3, 4, 5, 6, 3, 4, 7, 2, 3, 4]
    assert _propose(ctx, 4) == [5, 6, 3, 4]
    # With n capped at 2 the most recent [3, 4] wins.
    assert _propose(ctx, 4, hi=2) == [7, 2, 3, 4]


def test_most_recent_occurrence_and_caps():
    ctx = [1, 2, 9, 1, 2, 8, 1, 2]
    assert _propose(ctx, 3) == [8, 1, 2]
    assert _propose(ctx, 1) == [8]
    assert _propose(ctx, 0) == []
    # No occurrence is followed by 4 tokens: the earliest has the longest continuation ...
    assert _propose(ctx, 4) == [9, 1, 2, 8, 1, 2][:4]
    # ... which is truncated at the end of the context.
    assert _propose(ctx, 10) == [9, 1, 2, 8, 1, 2]
    assert _propose([4, 1, 2, 9, 1, 2], 10) == [9, 1, 2]
    # The most recent occurrence with room for the whole draft wins over a nearer one without.
    assert _propose([1, 2, 5, 6, 7, 1, 2, 3, 1, 2], 2) == [3, 1]
    assert _propose([1, 2, 5, 6, 7, 1, 2, 3, 1, 2], 3) == [3, 1, 2]
    assert _propose([1, 2, 5, 6, 7, 1, 2, 3, 1, 2], 4) == [5, 6, 7, 1]


def test_no_match():
    assert _propose([1, 2, 3, 4], 4) == []
    assert _propose([5], 4, lo=1) == []
    assert _propose([], 4, lo=1) == []
    # The last token recurs but the 2-gram does not: too short for prompt_lookup_min=2.
    assert _propose([5, 1, 7, 1], 4) == []
    assert _propose([5, 1, 7, 1], 4, lo=1) == [7, 1]


def test_match_is_never_the_suffix_itself():
    assert _propose([1, 2], 4, lo=1) == []
    assert _propose([1, 2, 1, 2], 4, lo=2) == [1, 2]
    assert _propose([3, 3], 4, lo=1) == [3]
    # An earlier occurrence may overlap the suffix (periodic text), as in vLLM.
    assert _propose([7, 7, 7], 4) == [7]
    assert _propose([1, 2, 1, 2, 1, 2], 4, lo=4, hi=4) == [1, 2]
    assert _propose([7] * 10, 4) == [7] * 4  # not the one-token continuation of the most recent "7 7"


@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force(seed: int):
    rng = random.Random(seed)
    for _ in range(300):
        vocab = rng.randint(2, 4)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(0, 6)
        assert _propose(tokens, k, lo, hi) == _reference(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_factory():
    assert isinstance(make_token_proposer(SpeculativeConfig(method="ngram")), NgramProposer)
    assert isinstance(make_token_proposer(SpeculativeConfig(method="suffix")), SuffixProposer)
    with pytest.raises(ValueError, match="draft_model"):
        make_token_proposer(SpeculativeConfig(method="draft_model"))
    p = NgramProposer(SpeculativeConfig(method="ngram"))
    p.remove_request("r", True)  # stateless: nothing to drop
