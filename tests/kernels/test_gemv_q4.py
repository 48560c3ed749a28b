"""The Q4_1 small-M linear kernel (pack_gemv_weight_q4 / gemv_q4) against F.linear on exactly-Q4_1 weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.kernels.build import load_kernels
from tests.conftest import requires_kernels
from tests.kernels.conftest import assert_gemv_close

kernels = load_kernels()
pytestmark = requires_kernels

TILE, GROUP = 64, 32
# Odd N (partial tiles) with K a multiple of the group, then SmolLM2's qkv, o_proj, gate_up, down and LM head.
SHAPES = [(1, 32), (100, 64), (130, 96), (960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
MS = [1, 2, 3, 5, 8, 16, 17, 40, 50, 97]  # above 16 (and above 2-4 for Q4): the fp32 panels; there, on two
# threads, the tiles left over (tiles % threads) are split by rows


def _q4_weight(n: int, k: int, g: torch.Generator, spanning: bool = False) -> torch.Tensor:
    """w = d * q + m in fp32 with fp16 d > 0 and m per group of 32 along K, q uniform in 0..15.

    spanning: every group holds the codes 0 and 15, as llama.cpp's Q4_1 quantizer produces them.
    """
    groups = k // GROUP
    d = (torch.rand(n, groups, 1, generator=g) * 0.01 + 1e-4).half().float()
    m = ((torch.rand(n, groups, 1, generator=g) - 0.7) * 0.1).half().float()
    q = torch.randint(0, 16, (n, groups, GROUP), generator=g).float()
    if spanning:
        q[:, :, 0], q[:, :, 1] = 0, 15
    return (d * q + m).reshape(n, k)


@pytest.mark.parametrize("n,k", SHAPES)
def test_pack_recovers_q4(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    for spanning in (True, False):
        w = _q4_weight(n, k, g, spanning)
        packed, err = kernels.pack_gemv_weight_q4(w, GROUP)
        assert packed.dtype == torch.uint8
        assert packed.shape == ((n + TILE - 1) // TILE, k // GROUP, GROUP // 2 * TILE + 4 * TILE)
        assert err.dtype == torch.float64 and err.item() < 1e-6
        assert kernels.q4_max_error(w, GROUP) == err.item()


def test_q4_max_error_flags_other_weights() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, 576, generator=g) * 0.02
    assert kernels.q4_max_error(w, GROUP) > 1e-2
    _, err = kernels.pack_gemv_weight_q4(w, GROUP)
    assert err.item() > 1e-2
    # 5 bits per weight: 32 levels do not fit 16 codes.
    q5 = torch.randint(0, 32, (64, 64), generator=g).float() * 0.01
    assert kernels.q4_max_error(q5, GROUP) > 1e-2
    assert kernels.q4_max_error(torch.zeros(3, 64), GROUP) == 0.0
    assert kernels.q4_max_error(torch.full((2, 32), 1e6), GROUP) == float("inf")  # beyond fp16


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_q4(n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k + 1)
    w = _q4_weight(n, k, g)
    bias = torch.randn(n, generator=g)
    packed, err = kernels.pack_gemv_weight_q4(w, GROUP)
    assert err.item() < 1e-6
    for m in MS if n * k <= 4_000_000 else [1, 5, 16, 33]:
        x = torch.randn(m, k, generator=g).to(dtype)
        for b in (None, bias):
            out = torch.full((m, n), float("nan"), dtype=dtype)
            kernels.gemv_q4(out, x, packed, b)
            assert_gemv_close(out, F.linear(x.double(), w.double(), None if b is None else b.double()).float())


@pytest.mark.parametrize("n", [576, 960, 130])  # 9, 15 and 3 tiles: one left over on two threads
def test_panel_rows_do_not_depend_on_the_rows_beside_them(n: int) -> None:
    """On the fp32 panels a row's output bits are the same whatever rows share the call, split by rows or not."""
    g = torch.Generator().manual_seed(n)
    w = _q4_weight(n, 576, g)
    packed, _ = kernels.pack_gemv_weight_q4(w, GROUP)
    x = torch.randn(200, 576, generator=g)
    full = torch.empty(200, n)
    kernels.gemv_q4(full, x, packed, None)
    for m0, m in [(0, 17), (3, 47), (5, 48), (60, 97), (199, 1), (100, 100)]:
        part = torch.empty(m, n)
        kernels.gemv_q4(part, x[m0:m0 + m].contiguous(), packed, None)
        if m > 16:  # (the direct kernels below: their own order)
            assert torch.equal(part, full[m0:m0 + m]), (m0, m)


def test_gemv_q4_other_group_size() -> None:
    g = torch.Generator().manual_seed(7)
    d, m = 2.0**-7, -0.0625  # fp16 values
    w = (torch.randint(0, 16, (70, 128), generator=g).float() * d + m).view(70, 2, 64)
    w[:, :, 0], w[:, :, 1] = m, m + 15 * d  # codes 0 and 15 in each group of 64
    w = w.reshape(70, 128)
    packed, err = kernels.pack_gemv_weight_q4(w, 64)
    assert packed.shape == (2, 2, 32 * TILE + 4 * TILE) and err.item() < 1e-6
    x = torch.randn(3, 128, generator=g)
    out = torch.empty(3, 70)
    kernels.gemv_q4(out, x, packed, None)
    assert_gemv_close(out, F.linear(x.double(), w.double()).float())


def test_gemv_q4_rejects_bad_inputs() -> None:
    w = _q4_weight(64, 64, torch.Generator().manual_seed(1))
    packed, _ = kernels.pack_gemv_weight_q4(w, GROUP)
    with pytest.raises(RuntimeError):
        kernels.pack_gemv_weight_q4(torch.randn(8, 40), GROUP)  # K not a multiple of the group
    with pytest.raises(RuntimeError):
        kernels.gemv_q4(torch.empty(1, 64), torch.randn(1, 32), packed, None)  # wrong K
    with pytest.raises(RuntimeError):
        kernels.gemv_q4(torch.empty(1, 65), torch.randn(1, 64), packed, None)  # N beyond the packed tiles
