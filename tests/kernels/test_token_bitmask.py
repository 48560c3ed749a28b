"""The structured-output bitmask kernel against the torch reference (every variant, via the kernels conftest)."""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels import load_kernels
from pagemill.kernels.ops import KernelLayerOps
from pagemill.sample.bitmask import apply_token_bitmask, apply_token_bitmask_torch
from tests.conftest import requires_kernels

pytestmark = requires_kernels


@pytest.mark.parametrize("vocab,words", [(49152, 1536), (100, 4), (70, 3), (70, 2), (33, 2)])
def test_apply_token_bitmask_matches_torch(vocab: int, words: int) -> None:
    g = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(6, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, words), dtype=torch.int32, generator=g)
    bitmask[0] = -1  # all allowed
    bitmask[1, : words // 2] = 0  # a run of forbidden words
    rows = torch.tensor([5, 0, 2, 3])
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask, rows, KernelLayerOps(load_kernels()))
    apply_token_bitmask_torch(ref, bitmask, rows)
    assert torch.equal(ours, ref)
    untouched = [1, 4]  # rows without a mask stay as they were
    assert torch.equal(ours[untouched], logits[untouched])
    bit = (bitmask[2, 0] & 1).item()
    assert (ours[2, 0] == logits[2, 0]) if bit else (ours[2, 0] == float("-inf"))


def test_apply_token_bitmask_rejects_bad_rows() -> None:
    with pytest.raises(RuntimeError, match="row out of range"):
        load_kernels().apply_token_bitmask(torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32),
                                           torch.tensor([2]))
