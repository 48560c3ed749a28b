"""int8_grid's codes (symmetric / asymmetric, plain / least-squares search, groups of 16 / 32): gemv_int8 on their
tiles computes F.linear of the weight they stand for, on every kernel variant; the fits are as close as claimed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.kernels.build import load_kernels
from pagemill.layers.quantization.gguf_records import unpack_int8
from pagemill.layers.quantization.int8_grid import dequantize_int8, int8_tiles, quantize_int8
from tests.conftest import requires_kernels
from tests.kernels.conftest import assert_gemv_close

kernels = load_kernels()
pytestmark = requires_kernels

SHAPES = [(130, 96), (576, 576)]  # a partial tile; SmolLM2's o_proj
MS = [1, 3, 16, 17, 40]  # above 16: the fp32-panel path


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :16] += 0.3  # a group far from zero: where an offset pays
    return w


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_int8_on_the_codes_is_linear_of_their_values(n, k, group, asymmetric, dtype):
    """Every row count (streamed and panel paths) multiplies by dequantize_int8; unpack_int8 reads the same."""
    w = _weight(n, k, n + group)
    codes = quantize_int8(w, group, asymmetric, search=True)
    tiles = int8_tiles(codes)
    wq = dequantize_int8(codes)
    assert torch.equal(unpack_int8(tiles, n, k), wq) and len(tiles) == (3 if asymmetric else 2)
    bias = torch.randn(n)
    for m in MS:
        x = torch.randn(m, k).to(dtype)
        for b in (None, bias):
            out = torch.full((m, n), float("nan"), dtype=dtype)
            kernels.gemv_int8(out, x, tiles[0], tiles[1], b, tiles[2] if asymmetric else None)
            assert_gemv_close(out, F.linear(x.float(), wq, b))


def _group_sq_error(w: torch.Tensor, group: int, asymmetric: bool, search: bool) -> torch.Tensor:
    return (dequantize_int8(quantize_int8(w, group, asymmetric, search)) - w).view(-1, group).square().sum(-1)


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("asymmetric", [False, True])
def test_search_never_loses_to_the_plain_fit(group, asymmetric):
    """The search keeps the plain fit among its candidates: no group's squared error grows, and the total shrinks."""
    w = _weight(256, 256, 7)
    plain, searched = (_group_sq_error(w, group, asymmetric, s) for s in (False, True))
    assert (searched <= plain * (1 + 1e-5) + 1e-12).all() and searched.sum() < 0.97 * plain.sum()


@pytest.mark.parametrize("group", [16, 32])
def test_asymmetric_error_within_a_step_and_below_symmetric(group):
    """Asymmetric codes stay within one step ((max - min) / 255) of each weight, and beat symmetric's error."""
    w = _weight(256, 256, 11)
    dq = dequantize_int8(quantize_int8(w, group, asymmetric=True, search=True))
    g = w.view(-1, group)
    step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 255
    assert ((dq.view(-1, group) - g).abs() <= step * 1.01).all()
    assert _group_sq_error(w, group, True, True).sum() < 0.9 * _group_sq_error(w, group, False, True).sum()


def test_weights_on_a_coarser_grid_come_back():
    """Weights on an 8-bit grid per group of 16, or on a Q4_1 grid per group of 32 (a GGUF model's values), are
    recovered by groups of 16 to float32 rounding."""
    torch.manual_seed(1)
    for levels, group in ((255, 16), (15, 32)):
        q = torch.randint(0, levels + 1, (64, 4, group)).float()
        q[..., 0], q[..., 1] = 0, levels  # each group spans the whole grid
        d, m = torch.rand(64, 4, 1) * 0.01, -torch.rand(64, 4, 1)
        w = (q * d + m).view(64, -1)
        dq = dequantize_int8(quantize_int8(w, 16, asymmetric=True, search=True))
        assert (dq - w).abs().max() <= 1e-6 * w.abs().max()


def test_constant_and_zero_groups():
    """A group with one value (or all zeros) is represented exactly, with no division by a zero range."""
    w = torch.zeros(64, 64)
    w[1] = 0.25
    w[2, :32] = -3.0
    for asymmetric in (False, True):
        for search in (False, True):
            dq = dequantize_int8(quantize_int8(w, 16, asymmetric, search))
            assert torch.isfinite(dq).all() and (dq - w).abs().max() <= 1e-6
