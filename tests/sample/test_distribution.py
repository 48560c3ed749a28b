"""The Sampler's draws follow the exact temperature / top-k / top-p / min-p distributions, row by row in one batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import pagemill.sample.sampler as sampler_mod
from pagemill.sample.metadata import SamplingMetadata
from pagemill.sample.sampler import Sampler
from pagemill.sampling_params import SamplingParams
from tests.sample.harness import (Req, SampleFn, assert_distributions, build_metadata, draw_counts, failing_rows,
                                  reference_probs)

VOCAB = 32
REPS = 20_000  # draws per row, all in one Sampler call


def _logits() -> tuple[list[str], torch.Tensor, list[SamplingParams]]:
    """Named rows: (name, params); each row its own fixed logits (distinct values unless a tie is the point)."""
    g = torch.Generator().manual_seed(11)
    cases = {
        "plain": SamplingParams(),
        "t0.5": SamplingParams(temperature=0.5),
        "t1.7_k5": SamplingParams(temperature=1.7, top_k=5),
        "k3_tie": SamplingParams(top_k=3),  # the 3rd and 4th logits tie: vLLM keeps both
        "p0.8": SamplingParams(top_p=0.8),
        "minp0.1": SamplingParams(min_p=0.1),
        "t0.8_k8_p0.9": SamplingParams(temperature=0.8, top_k=8, top_p=0.9),
        "t1.3_minp0.05_p0.7": SamplingParams(temperature=1.3, min_p=0.05, top_p=0.7),  # min-p before top-p matters
        "all": SamplingParams(temperature=0.9, top_k=10, top_p=0.85, min_p=0.02),
        "greedy": SamplingParams(temperature=0.0, top_k=3, top_p=0.5),
        "k1": SamplingParams(temperature=2.0, top_k=1),
    }
    rows = torch.randn(len(cases), VOCAB, generator=g) * 1.5
    tie = list(cases).index("k3_tie")
    rows[tie] = torch.linspace(-2.0, 0.5, VOCAB)
    rows[tie, :4] = torch.tensor([3.0, 2.0, 1.5, 1.5])
    return list(cases), rows, list(cases.values())


NAMES, LOGITS, PARAMS = _logits()
EXPECTED = torch.stack([reference_probs(row, p) for row, p in zip(LOGITS, PARAMS)])


def _md() -> SamplingMetadata:
    """The batch's metadata, one row per case, built by the model runner's code."""
    return build_metadata([Req(p) for p in PARAMS], VOCAB)


def _failing(sample: SampleFn | None = None) -> dict[str, str]:
    """Rows whose REPS draws (by `sample`, default the real Sampler) fail the distribution check."""
    return failing_rows(draw_counts(LOGITS, _md(), REPS, sample), EXPECTED, NAMES)


def test_reference_is_not_trivial() -> None:
    """The designs exercise what they name: filters really cut, the tie keeps 4, min-p-then-top-p differs."""
    support = {name: int((e > 0).sum()) for name, e in zip(NAMES, EXPECTED)}
    assert support["k3_tie"] == 4 and support["t1.7_k5"] == 5 and support["greedy"] == support["k1"] == 1
    assert 1 < support["p0.8"] < VOCAB and 1 < support["minp0.1"] < VOCAB and support["plain"] == VOCAB
    # top-p of the whole distribution would keep more than top-p of what min-p left
    i = NAMES.index("t1.3_minp0.05_p0.7")
    top_p_first = reference_probs(LOGITS[i], replace(PARAMS[i], min_p=0.0)) > 0
    assert int(top_p_first.sum()) > support["t1.3_minp0.05_p0.7"]


def test_sampler_matches_reference_distributions() -> None:
    """20k draws per row in one mixed batch fit the exact distributions (chi-square, p >= 1e-6 per row)."""
    counts = draw_counts(LOGITS, _md(), REPS)
    assert_distributions(counts, EXPECTED, NAMES)


# --- the harness fails on deliberately broken samplers --------------------------------------------------------

_TOP_K_TOP_P = sampler_mod.apply_top_k_top_p
_MIN_P = sampler_mod.apply_min_p


def _nucleus_off_by(shift: int):
    """A top-p that keeps `shift` tokens more (or fewer) than the nucleus."""

    def broken(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
        logits = _TOP_K_TOP_P(logits, top_k, None)
        if top_p is None:
            return logits
        probs = logits.softmax(-1)
        sorted_p, idx = probs.sort(-1, descending=True)
        n_keep = ((sorted_p.cumsum(-1) - sorted_p) < top_p[:, None]).sum(-1, keepdim=True)
        n_keep = torch.where(top_p[:, None] < 1.0, n_keep + shift, n_keep).clamp(1, logits.shape[-1])
        drop_sorted = torch.arange(logits.shape[-1]).expand_as(idx) >= n_keep
        return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted), float("-inf"))

    return broken


def _top_k_plus_one(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Broken: top-k keeps k + 1 tokens."""
    return _TOP_K_TOP_P(logits, None if top_k is None else torch.where(top_k > 0, top_k + 1, top_k), top_p)


def _temperature_ignored(logits: torch.Tensor, md: SamplingMetadata):
    """Broken: a sampler that ignores temperature."""
    return Sampler()(logits, replace(md, temperature=torch.ones_like(md.temperature)))


def _one_top_k_for_the_batch(logits: torch.Tensor, md: SamplingMetadata):
    """Broken: one top_k (the largest) for every row instead of each row's own."""
    return Sampler()(logits, replace(md, top_k=torch.full_like(md.top_k, int(md.top_k.max()))))


def _min_p_after_top_p(logits: torch.Tensor, md: SamplingMetadata):
    """Broken: min-p applied after top-k / top-p (HF's order, pagemill's before the fix) instead of before."""
    min_p = md.min_p
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sampler_mod, "apply_top_k_top_p", lambda x, k, p: _MIN_P(_TOP_K_TOP_P(x, k, p), min_p))
        return Sampler()(logits, replace(md, min_p=None))


@pytest.mark.parametrize("broken,attr,must_fail", [
    (_top_k_plus_one, "apply_top_k_top_p", {"t1.7_k5", "k1"}),
    (_nucleus_off_by(+1), "apply_top_k_top_p", {"p0.8", "t0.8_k8_p0.9", "t1.3_minp0.05_p0.7", "all"}),
    (_nucleus_off_by(-1), "apply_top_k_top_p", {"p0.8", "t0.8_k8_p0.9", "t1.3_minp0.05_p0.7", "all"}),
    (lambda logits, min_p: logits, "apply_min_p", {"minp0.1", "t1.3_minp0.05_p0.7"}),  # min-p not applied
    (_temperature_ignored, None, {"t0.5", "t1.7_k5", "t0.8_k8_p0.9", "t1.3_minp0.05_p0.7"}),
    (_one_top_k_for_the_batch, None, {"plain", "t1.7_k5", "k3_tie", "p0.8", "k1"}),  # per-row top_k lost
    (_min_p_after_top_p, None, {"t1.3_minp0.05_p0.7"}),  # the order pagemill had before (HF's order)
], ids=["top_k+1", "top_p+1_token", "top_p-1_token", "min_p_ignored", "temperature_ignored", "batch_top_k",
        "min_p_after_top_p"])
def test_harness_rejects_broken_sampler(monkeypatch: pytest.MonkeyPatch, broken, attr: str | None,
                                        must_fail: set[str]) -> None:
    """Each deliberately broken mask is caught on the rows it affects."""
    if attr is not None:
        monkeypatch.setattr(sampler_mod, attr, broken)
        bad = _failing()
    else:
        bad = _failing(broken)
    assert must_fail <= set(bad), f"not caught: {sorted(must_fail - set(bad))} (failing: {bad})"
    assert "greedy" not in bad
