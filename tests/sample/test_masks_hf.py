"""The top-k, top-p and min-p masks, one per row with its own value, equal HF transformers' logits warpers."""

from __future__ import annotations

import torch
from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from pagemill.sample.sampler import apply_min_p, apply_top_k_top_p

ROWS, VOCAB = 300, 50


def _logits() -> torch.Tensor:
    """Fixed random logits, every third row with a run of tied values."""
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    logits[::3, 10:14] = logits[::3, 10:11]  # ties
    return logits


def _hf_kept(warper, row: torch.Tensor) -> torch.Tensor:
    """The tokens an HF warper leaves finite in one row."""
    return torch.isfinite(warper(None, row.clone()[None])[0])


def test_top_k_mask_matches_hf() -> None:
    """Per-row top-k keeps what TopKLogitsWarper keeps (ties at the k-th value included)."""
    logits = _logits()
    k = torch.arange(ROWS) % (VOCAB + 5) + 1  # 1 .. VOCAB + 5
    ours = torch.isfinite(apply_top_k_top_p(logits.clone(), k, None))
    for i in range(ROWS):
        assert torch.equal(ours[i], _hf_kept(TopKLogitsWarper(int(min(k[i], VOCAB))), logits[i])), i


def test_top_p_mask_matches_hf() -> None:
    """Per-row top-p keeps what TopPLogitsWarper keeps (the smallest prefix reaching p, at least one token)."""
    logits = _logits()
    p = torch.linspace(0.01, 1.0, ROWS)
    ours = torch.isfinite(apply_top_k_top_p(logits.clone(), None, p))
    for i in range(ROWS):
        assert torch.equal(ours[i], _hf_kept(TopPLogitsWarper(float(p[i])), logits[i])), i


def test_min_p_mask_matches_hf() -> None:
    """Per-row min-p keeps what MinPLogitsWarper keeps (p >= min_p * p_max)."""
    logits = _logits()
    min_p = torch.linspace(0.0, 1.0, ROWS)
    ours = torch.isfinite(apply_min_p(logits.clone(), min_p))
    for i in range(ROWS):
        assert torch.equal(ours[i], _hf_kept(MinPLogitsWarper(float(min_p[i])), logits[i])), i
