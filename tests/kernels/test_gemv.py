"""The weight-streaming linear kernels (gemv_f16, gemv_int8) against F.linear on the same (rounded) weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.kernels.build import load_kernels
from tests.conftest import requires_kernels
from tests.kernels.conftest import assert_gemv_close

kernels = load_kernels()
pytestmark = requires_kernels

TILE = 64
# Non-multiples of 16 / 64 in N and K, then SmolLM2's qkv, o_proj, gate_up, down.
SHAPES = [(1, 1), (17, 33), (100, 200), (130, 77), (960, 576), (576, 576), (3072, 576), (576, 1536)]
MS = [1, 2, 3, 5, 8, 16, 17, 40, 50, 97]  # above 16 (and above 2-4 for Q4): the fp32 panels; there, on two
# threads, the tiles left over (tiles % threads) are split by rows


def _dequant(q: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [n, k] float weight that packed int8 (q [T, Kp, 64], scales [T, Kp/G, 64]) stands for."""
    qf = q.permute(0, 2, 1).reshape(-1, q.shape[1]).float()
    s = scales.permute(0, 2, 1).reshape(-1, scales.shape[1])
    return (qf * s.repeat_interleave(q.shape[1] // scales.shape[1], dim=1))[:n, :k]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_f16(n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g)
    packed = kernels.pack_gemv_weight_f16(w)
    assert packed.shape == ((n + TILE - 1) // TILE, k, TILE) and packed.dtype == torch.float16
    w16 = w.half().float()
    for m in MS:
        x = torch.randn(m, k, generator=g).to(dtype)
        for b in (None, bias):
            out = torch.full((m, n), float("nan"), dtype=dtype)
            kernels.gemv_f16(out, x, packed, b)
            assert_gemv_close(out, F.linear(x.float(), w16, b))


def test_gemv_f16_from_half_and_bf16() -> None:
    w = torch.randn(70, 40) * 0.1
    x = torch.randn(3, 40)
    for wd in (torch.float16, torch.bfloat16):
        out = torch.empty(3, 70)
        kernels.gemv_f16(out, x, kernels.pack_gemv_weight_f16(w.to(wd)), None)
        assert_gemv_close(out, F.linear(x, w.to(wd).half().float()))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("group", [32, 128, 0])  # 0: per channel (group = K)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_int8(n: int, k: int, group: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k + group)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g)
    q, scales = kernels.pack_gemv_weight_int8(w, group or k)
    gs = min(group or k, k)
    kp = (k + gs - 1) // gs * gs
    assert q.dtype == torch.int8 and q.shape == ((n + TILE - 1) // TILE, kp, TILE)
    assert scales.dtype == torch.float32 and scales.shape == (q.shape[0], kp // gs, TILE)
    wq = _dequant(q, scales, n, k)
    for m in MS:
        x = torch.randn(m, k, generator=g).to(dtype)
        for b in (None, bias):
            out = torch.full((m, n), float("nan"), dtype=dtype)
            kernels.gemv_int8(out, x, q, scales, b)
            assert_gemv_close(out, F.linear(x.float(), wq, b))


@pytest.mark.parametrize("group", [64, 192, 576])  # dividing K; partial groups: below
def test_int8_quantization_error_bounded(group: int) -> None:
    torch.manual_seed(group)
    w = torch.randn(576, 576) * 0.05
    w[3, 10] = 2.0  # an outlier only inflates its own group's scale
    q, scales = kernels.pack_gemv_weight_int8(w, group)
    wq = _dequant(q, scales, 576, 576)
    # Symmetric rounding: |w - wq| <= scale / 2 = max|group| / 254 elementwise, up to the float32 rounding of w / scale
    # (codes up to 127: one ulp of 127 is 7.6e-6 of a step, 1.5e-5 of the half step; seen at 1.000015 on random data).
    gmax = w.abs().view(576, -1, group).amax(-1, keepdim=True).expand(-1, -1, group).reshape(576, 576)
    assert ((w - wq).abs() <= gmax / 254 * (1 + 1e-4) + 1e-9).all()
    assert ((w - wq).norm() / w.norm()).item() < 0.02
    # Zero rows (e.g. padding) quantize to exact zeros, not NaN.
    q0, s0 = kernels.pack_gemv_weight_int8(torch.zeros(5, 40), group)
    assert not torch.isnan(s0).any() and (_dequant(q0, s0, 5, 40) == 0).all()


def test_int8_group_not_dividing_k() -> None:
    """K = 576 with groups of 128: the last group is partial (K is zero-padded to 640 in the packing)."""
    w = torch.randn(64, 576)
    q, scales = kernels.pack_gemv_weight_int8(w, 128)
    assert q.shape[1] == 640 and scales.shape[1] == 5
    x = torch.randn(2, 576)
    out = torch.empty(2, 64)
    kernels.gemv_int8(out, x, q, scales, None)
    assert_gemv_close(out, F.linear(x, _dequant(q, scales, 64, 576)))


def test_rejects_bad_inputs() -> None:
    packed = kernels.pack_gemv_weight_f16(torch.randn(32, 16))
    with pytest.raises(RuntimeError):
        kernels.gemv_f16(torch.empty(1, 32), torch.randn(1, 17), packed, None)  # wrong K
    with pytest.raises(RuntimeError):
        kernels.gemv_f16(torch.empty(1, 65), torch.randn(1, 16), packed, None)  # N beyond the packed tiles
