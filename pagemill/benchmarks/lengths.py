"""Seeded request-length distributions: uniform (random dataset) and clipped lognormal.

The clipped lognormal reproduces the length statistics of the PagedAttention paper's traces
(ShareGPT mean input 161.31 / output 337.99 tokens; Alpaca 19.31 / 58.45) without the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LogNormalSpec:
    """A lognormal length distribution with shape `sigma`, clipped to [low, high], with given mean."""

    mean: float
    sigma: float
    low: int
    high: int


SHAREGPT_INPUT = LogNormalSpec(mean=161.31, sigma=1.0, low=4, high=1024)
SHAREGPT_OUTPUT = LogNormalSpec(mean=337.99, sigma=0.9, low=4, high=1024)
ALPACA_INPUT = LogNormalSpec(mean=19.31, sigma=0.6, low=4, high=256)
ALPACA_OUTPUT = LogNormalSpec(mean=58.45, sigma=0.8, low=4, high=512)


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, low: float, high: float) -> float:
    """Exact mean of clip(exp(N(mu, sigma^2)), low, high)."""
    za, zb = (math.log(low) - mu) / sigma, (math.log(high) - mu) / sigma
    inside = math.exp(mu + sigma * sigma / 2) * (_normal_cdf(zb - sigma) - _normal_cdf(za - sigma))
    return low * _normal_cdf(za) + high * (1.0 - _normal_cdf(zb)) + inside


def solve_mu(spec: LogNormalSpec) -> float:
    """Find the log-space location mu whose clipped lognormal has mean `spec.mean` (bisection)."""
    if not spec.low < spec.mean < spec.high:
        raise ValueError(f"mean {spec.mean} must lie strictly between low {spec.low} and high {spec.high}")
    lo, hi = math.log(spec.low) - 10 * spec.sigma, math.log(spec.high) + 10 * spec.sigma
    for _ in range(200):
        mid = (lo + hi) / 2
        if clipped_lognormal_mean(mid, spec.sigma, spec.low, spec.high) < spec.mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def sample_lognormal_lengths(spec: LogNormalSpec, n: int, rng: np.random.Generator) -> list[int]:
    """Draw `n` integer lengths from the clipped lognormal `spec`."""
    draws = rng.lognormal(mean=solve_mu(spec), sigma=spec.sigma, size=n)
    return [int(x) for x in np.clip(np.rint(draws), spec.low, spec.high)]


def sample_uniform_lengths(length: int, range_ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """Draw `n` lengths uniformly from [length*(1-r), length*(1+r)] (inclusive), as `vllm bench`."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(0, math.ceil(length * (1 - range_ratio)))
    high = math.floor(length * (1 + range_ratio))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]
