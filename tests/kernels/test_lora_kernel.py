"""The multi-LoRA delta kernel (csrc/cpu/variant/lora.cpp) against the torch reference (two matmuls per run), on each
ISA variant (the kernels conftest runs every test once per variant), and its argument checks."""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels.ops import TorchLayerOps
from tests.conftest import require_kernels, requires_kernels

pytestmark = requires_kernels


@pytest.fixture
def kernels():
    return require_kernels()


def operands(T: int, K: int, N: int, width: int, slots: int, seed: int):
    """Random y, x, stacked A [slots, K, width] and B [slots, width, N] at LoRA-like scales."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(T, N, generator=gen)
    x = torch.randn(T, K, generator=gen)
    lora_a = (torch.rand(slots, K, width, generator=gen) * 2 - 1) * K ** -0.5
    lora_b = torch.randn(slots, width, N, generator=gen) * 0.1
    return y, x, lora_a, lora_b


def check_against_torch(kernels, T, K, N, width, slots, runs, seed=0) -> None:
    y, x, lora_a, lora_b = operands(T, K, N, width, slots, seed)
    runs_t = torch.tensor(runs, dtype=torch.int32).reshape(-1, 3)
    ref = y.double()
    for a, b, s in runs:  # float64 reference
        ref[a:b] += (x[a:b].double() @ lora_a[s].double()) @ lora_b[s].double()
    expect = y.clone()
    TorchLayerOps().lora_delta(expect, x, lora_a, lora_b, runs_t)
    out = y.clone()
    kernels.lora_delta(out, x, lora_a, lora_b, runs_t)
    scale = (ref - y.double()).abs().max().item() + 1.0
    assert (out.double() - ref).abs().max().item() <= 1e-5 * scale
    assert torch.allclose(out, expect, rtol=1e-5, atol=1e-5 * scale)
    covered = torch.zeros(T, dtype=torch.bool)
    for a, b, _ in runs:
        covered[a:b] = True
    assert torch.equal(out[~covered], y[~covered])  # rows in no run (base-model tokens) are untouched


@pytest.mark.parametrize("width", [16, 32, 48])
@pytest.mark.parametrize("K,N", [(576, 960), (37, 101), (64, 3), (1536, 576)])
def test_runs_of_several_adapters_equal_torch(kernels, K, N, width):
    # 32 decode tokens over 4 slots with base-model gaps, a run of one token, and slot 1 used twice.
    runs = [(0, 8, 2), (8, 9, 1), (11, 19, 0), (19, 26, 3), (28, 32, 1)]
    check_against_torch(kernels, 32, K, N, width, 4, runs, seed=K + N + width)


@pytest.mark.parametrize("T,runs", [
    (1, [(0, 1, 0)]),  # one token
    (5, []),  # no run: nothing changes
    (7, [(0, 0, 1), (0, 7, 1)]),  # an empty run
    (50, [(0, 13, 0), (13, 50, 1)]),  # long runs (prefill chunks): many row blocks
    (9, [(i, i + 1, i % 3) for i in range(9)]),  # every token its own run
])
def test_edge_cases_equal_torch(kernels, T, runs):
    check_against_torch(kernels, T, 45, 77, 24, 3, runs, seed=T)


def test_a_row_does_not_depend_on_its_batch(kernels):
    """Each row's result is the same whatever else the call holds (the blocks keep one summation order per row)."""
    y, x, lora_a, lora_b = operands(20, 96, 200, 32, 2, seed=5)
    alone = y[7:8].clone()
    kernels.lora_delta(alone, x[7:8].contiguous(), lora_a, lora_b, torch.tensor([[0, 1, 1]], dtype=torch.int32))
    batched = y.clone()
    kernels.lora_delta(batched, x, lora_a, lora_b, torch.tensor([[0, 5, 0], [5, 20, 1]], dtype=torch.int32))
    assert torch.equal(batched[7], alone[0])


def test_bad_arguments_are_clear_errors(kernels):
    y, x, lora_a, lora_b = operands(8, 32, 40, 16, 2, seed=1)
    runs = torch.tensor([[0, 8, 1]], dtype=torch.int32)
    cases = [
        ((y.double(), x, lora_a, lora_b, runs), "y must be a contiguous float32"),
        ((y, x.t().contiguous().t(), lora_a, lora_b, runs), "x must be a contiguous float32"),
        ((y, x[:4], lora_a, lora_b, runs), "x has 4 rows"),
        ((y, x, lora_a[:, :16], lora_b, runs), "lora_a must be"),
        ((y, x, lora_a, lora_b[:, :8], runs), "lora_b must be"),
        ((y, x, lora_a, lora_b, runs.long()), "runs must be a contiguous int32"),
        ((y, x, lora_a, lora_b, torch.tensor([[0, 9, 0]], dtype=torch.int32)), r"runs\[0\].*within the 8 rows"),
        ((y, x, lora_a, lora_b, torch.tensor([[0, 5, 0], [4, 8, 1]], dtype=torch.int32)), "sorted, disjoint"),
        ((y, x, lora_a, lora_b, torch.tensor([[3, 2, 0]], dtype=torch.int32)), "sorted, disjoint"),
        ((y, x, lora_a, lora_b, torch.tensor([[0, 8, 2]], dtype=torch.int32)), "slot 2 of 2"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            kernels.lora_delta(*args)
