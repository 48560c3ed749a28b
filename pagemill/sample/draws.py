"""The sampler's random draws: inverse-CDF sampling with one uniform per logits row.

A seeded request's uniform for its t-th output token is a hash of (seed, t): it depends on nothing else, so the
request's tokens do not change with the batch around it, preemption, or speculative decoding (a verified position
draws the uniform it would have drawn in a plain step). Unseeded rows draw from torch's global generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1
SAMPLE_STREAM = 0  # the uniform that picks a position's token
ACCEPT_STREAM = 1  # the uniform that accepts or rejects a probabilistic draft at a position

SeedPositions = dict[int, tuple[int, int]]  # logits row -> (seed, output position of the token the row samples)


def _splitmix64(x: int) -> int:
    """One round of SplitMix64 (a bijective 64-bit mixer with full avalanche)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int, stream: int = SAMPLE_STREAM) -> float:
    """U(0, 1] for output position `position` of a request seeded `seed` (53 random bits, never 0)."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ stream)
    return ((h >> 11) + 1) * 2.0 ** -53


def row_uniforms(rows: Sequence[int], seeds: SeedPositions, stream: int = SAMPLE_STREAM) -> torch.Tensor:
    """U(0, 1] float32 [len(rows)]: a seeded row's from its (seed, position), the others from the global RNG."""
    u = 1.0 - torch.rand(len(rows))  # (0, 1]: a zero would pick a zero-probability first token
    if seeds:
        hits = [(j, seeds[r]) for j, r in enumerate(rows) if r in seeds]
        if hits:
            idx = torch.tensor([j for j, _ in hits], dtype=torch.long)
            u[idx] = torch.tensor([seeded_uniform(s, p, stream) for _, (s, p) in hits], dtype=torch.float32)
    return u


def inverse_cdf_sample(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative `weights` [R, V] (unnormalised), the first token whose cumulative weight reaches
    u * total: a draw from the row's distribution that never picks a zero-weight token (u > 0). Int64 [R]."""
    cum = weights.cumsum(dim=-1)
    target = (uniforms.to(cum.device, cum.dtype) * cum[:, -1]).unsqueeze(1)
    # (u <= 1 and rounding is monotonic, so u * total <= cum[-1]: the search ends inside the row; the clamp only
    # keeps a NaN row, from a broken model, from indexing past the vocabulary)
    return torch.searchsorted(cum, target).squeeze(1).clamp_(max=weights.shape[-1] - 1)
