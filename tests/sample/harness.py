"""Sampler test harness: the runner's real SamplingMetadata, exact reference distributions, many-draw checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from pagemill.core.sched_output import NewRequestData
from pagemill.sample.metadata import SamplingMetadata
from pagemill.sample.sampler import Sampler
from pagemill.sampling_params import _SAMPLING_EPS, SamplingParams
from pagemill.worker.input_batch import InputBatch
from pagemill.worker.model_runner import ModelRunner

SampleFn = Callable[[torch.Tensor, SamplingMetadata], tuple[torch.Tensor, torch.Tensor | None]]
P_VALUE_FLOOR = 1e-6  # a correct sampler fails one row's check with about this probability
MIN_EXPECTED = 5.0  # chi-square bins with fewer expected draws are pooled
AMBIGUITY = 1e-4  # reference boundaries closer than this (float32 vs float64) make a test design invalid


@dataclass
class Req:
    """One request in a sampled batch: its parameters and token history."""

    params: SamplingParams
    prompt: list[int] = field(default_factory=lambda: [0])
    output: list[int] = field(default_factory=list)
    eos: int | None = None


class _RunnerMetadata:
    """Hosts ModelRunner's own metadata code (`_sampling_metadata`, `_penalty_metadata`, `_argmax_only`) on a real
    InputBatch."""

    _sampling_metadata = ModelRunner._sampling_metadata
    _argmax_only = ModelRunner._argmax_only
    _penalty_metadata = ModelRunner._penalty_metadata

    def __init__(self, vocab_size: int, max_num_reqs: int, max_model_len: int) -> None:
        self.vocab_size = vocab_size
        self.input_batch = InputBatch(max_num_reqs, max_model_len, block_size=16)


def build_metadata(reqs: list[Req], vocab_size: int) -> SamplingMetadata:
    """SamplingMetadata for these requests (row i = reqs[i]), built exactly as the model runner builds it."""
    width = max(len(r.prompt) + len(r.output) for r in reqs) + 1
    runner = _RunnerMetadata(vocab_size, len(reqs), width)
    rows = []
    for i, r in enumerate(reqs):
        tokens = r.prompt + r.output
        new = NewRequestData(f"r{i}", tokens, len(r.prompt), r.params, [[0]], len(tokens), r.eos)
        rows.append(runner.input_batch.add_request(new))
    return runner._sampling_metadata(np.array(rows))


def tile_metadata(md: SamplingMetadata, reps: int) -> SamplingMetadata:
    """Each row repeated `reps` times in place (row i -> rows i*reps .. i*reps+reps-1); unseeded rows only."""
    assert not md.seeds, "tile only unseeded rows: a seeded row's copies would draw the same uniform"

    def rep(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat_interleave(reps, dim=0)

    blocks = None
    if md.min_tokens_blocks:
        blocks = [(row * reps + j, ids) for row, ids in md.min_tokens_blocks for j in range(reps)]
    return replace(md, temperature=rep(md.temperature), greedy_mask=rep(md.greedy_mask), top_p=rep(md.top_p),
                   top_k=rep(md.top_k), min_p=rep(md.min_p), presence_penalty=rep(md.presence_penalty),
                   frequency_penalty=rep(md.frequency_penalty), repetition_penalty=rep(md.repetition_penalty),
                   prompt_token_ids=rep(md.prompt_token_ids), output_token_ids=rep(md.output_token_ids),
                   min_tokens_blocks=blocks)


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The exact next-token distribution (float64) from the definitions, in vLLM's order: temperature, min-p
    (p >= min_p * p_max), top-k (keep logits >= the k-th largest, so ties at the k-th are kept), top-p (keep a
    token when the mass of the more likely tokens before it is < top_p); greedy is one-hot on the argmax."""
    z = logits.to(torch.float64)
    if p.temperature < _SAMPLING_EPS:
        return torch.nn.functional.one_hot(z.argmax(), z.numel()).to(torch.float64)
    z = z / p.temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if p.min_p > 0:
        probs = z.softmax(-1)
        threshold = p.min_p * probs.max()
        assert ((probs - threshold).abs() > AMBIGUITY * threshold).all(), "min-p boundary too close to call"
        keep &= probs >= threshold
    if 0 < p.top_k < z.numel():
        keep &= z >= z.sort(descending=True).values[p.top_k - 1]
    if p.top_p < 1.0:
        probs = z.masked_fill(~keep, -math.inf).softmax(-1)
        order = probs.argsort(descending=True, stable=True)
        before = probs[order].cumsum(0) - probs[order]
        kept = before[probs[order] > 0]
        assert ((kept - p.top_p).abs() > AMBIGUITY).all(), "top-p boundary too close to call"
        nucleus = torch.zeros_like(keep)
        nucleus[order] = before < p.top_p
        keep &= nucleus
    return z.masked_fill(~keep, -math.inf).softmax(-1)


def draw_counts(logits: torch.Tensor, md: SamplingMetadata, reps: int, sample: SampleFn | None = None,
                seed: int = 0) -> torch.Tensor:
    """Counts [rows, vocab] of `reps` draws per row of `logits`, all in one batch (rows tiled), by the Sampler."""
    torch.manual_seed(seed)
    tokens, _ = (sample or Sampler())(logits.repeat_interleave(reps, dim=0), tile_metadata(md, reps))
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab, dtype=torch.float64)
    counts.scatter_add_(1, tokens.view(rows, reps).long(), torch.ones(rows, reps, dtype=torch.float64))
    return counts


def p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of one row; 0.0 when any draw hit a token of probability zero."""
    n = counts.sum()
    support = expected_probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    obs, exp = counts[support], expected_probs[support] * n
    small = exp < MIN_EXPECTED
    if small.any():  # pool the rare tokens into one bin
        obs = torch.cat([obs[~small], obs[small].sum().view(1)])
        exp = torch.cat([exp[~small], exp[small].sum().view(1)])
    df = obs.numel() - 1
    if df == 0:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def total_variation(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Total-variation distance between the empirical and the expected distribution of one row."""
    return float((counts / counts.sum() - expected_probs).abs().sum() / 2)


def failing_rows(counts: torch.Tensor, expected: torch.Tensor, names: list[str]) -> dict[str, str]:
    """{row name: why} for the rows whose draws do not fit the expected distribution (p-value < floor)."""
    bad = {}
    for name, c, e in zip(names, counts, expected):
        pv = p_value(c, e)
        if pv < P_VALUE_FLOOR:
            bad[name] = f"p={pv:.3g} TV={total_variation(c, e):.4f}"
    return bad


def assert_distributions(counts: torch.Tensor, expected: torch.Tensor, names: list[str]) -> None:
    """Fails naming every row whose draws do not fit its expected distribution."""
    bad = failing_rows(counts, expected, names)
    assert not bad, f"sampled distributions differ from the reference: {bad}"
