"""Seeded requests: a row's draw is keyed by its seed and output position, so it depends on nothing else."""

from __future__ import annotations

import torch

from pagemill.sample.sampler import Sampler
from pagemill.sampling_params import SamplingParams
from tests.sample.harness import Req, build_metadata

VOCAB = 50
STEPS = 40


def _draws(seeds: list[int | None], temperature: float = 1.0) -> list[list[int]]:
    """STEPS tokens per row from near-uniform logits, each step's metadata built by the runner's code from the
    tokens so far (so a row's output position advances as in the engine)."""
    logits = torch.linspace(0.0, 0.5, VOCAB).expand(len(seeds), VOCAB)
    reqs = [Req(SamplingParams(seed=s, temperature=temperature, top_k=40)) for s in seeds]
    sampler = Sampler()
    for _ in range(STEPS):
        for r, t in zip(reqs, sampler(logits.clone(), build_metadata(reqs, VOCAB))[0].tolist()):
            r.output.append(t)
    return [r.output for r in reqs]


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
