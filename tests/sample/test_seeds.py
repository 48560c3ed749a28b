"""Seeded requests: one generator per row, so the draws depend on the seed only, not on the batch."""

from __future__ import annotations

import torch

from pagemill.sample.sampler import Sampler
from pagemill.sampling_params import SamplingParams
from tests.sample.harness import Req, build_metadata

VOCAB = 50
STEPS = 40


def _draws(seeds: list[int | None], temperature: float = 1.0) -> list[list[int]]:
    """STEPS tokens per row from near-uniform logits, the rows' generators carried across steps as the runner does."""
    logits = torch.linspace(0.0, 0.5, VOCAB).expand(len(seeds), VOCAB)
    md = build_metadata([Req(SamplingParams(seed=s, temperature=temperature, top_k=40)) for s in seeds], VOCAB)
    sampler = Sampler()
    steps = [sampler(logits.clone(), md)[0].tolist() for _ in range(STEPS)]
    return [list(row) for row in zip(*steps)]


def test_same_seed_same_tokens_in_one_batch() -> None:
    """Two rows with seed 7 draw identical tokens; seed 8 and an unseeded row draw others."""
    torch.manual_seed(0)
    a, unseeded, b, c = _draws([7, None, 7, 8])
    assert a == b
    assert a != c and a != unseeded
    assert len(set(a)) > 10  # really random draws, not a constant


def test_seeded_draws_do_not_depend_on_the_batch() -> None:
    """The same seed alone in a batch, or among other rows, gives the same tokens (global RNG state irrelevant)."""
    torch.manual_seed(1)
    alone = _draws([7])[0]
    torch.manual_seed(2)
    mixed = _draws([None, 3, 7, None])[2]
    assert alone == mixed
