"""The one-row kernels over 4-bit records that multiply in integers (csrc/cpu/variant/gemv_i8.cpp, records_decode): on
AVX2 the exact path splits x into three int8 levels per block of 32 and must stay within float32 noise of the true
product, as the float kernel does, also where a block mixes an outlier with tiny values; the int8 preset's rows take
the same kernel with one level."""

from __future__ import annotations

import pytest
import torch

from pagemill.layers.quantization.gguf import pack_records
from pagemill.layers.quantization.gguf_records import PLANE_LAYOUTS
from tests.conftest import requires_kernels
from tests.kernels.gguf_blocks import dequantized, make_blocks
from pagemill.kernels.build import load_kernels

kernels = load_kernels()

FOUR_BIT = ["q4_0", "q4_1", "q4_k", "q2_k", "q3_k"]


def _run(kind: str, records, x: torch.Tensor, n: int, **flags) -> torch.Tensor:
    out = torch.empty(x.shape[0], n)
    kernels.gemv_records(out, x, records, PLANE_LAYOUTS[kind][3], None, **flags)
    return out


def _inputs(k: int, g: torch.Generator) -> list[torch.Tensor]:
    """A Gaussian row, and one whose blocks each hold an outlier 1e4 times the rest."""
    plain = torch.randn(1, k, generator=g)
    outliers = torch.randn(1, k, generator=g) * 1e-2
    outliers[0, ::32] = 100.0 * torch.sign(torch.randn(k // 32, generator=g))
    return [plain, outliers]


@requires_kernels
@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_one_row_is_float32_exact(fmt: str) -> None:
    g = torch.Generator().manual_seed(1)
    n, k = 130, 512
    kind, records = pack_records([(fmt, make_blocks(fmt, n, k, seed=7))])
    assert kind != "int8"
    w = dequantized(fmt, make_blocks(fmt, n, k, seed=7)).view(n, k).double()
    for x in _inputs(k, g):
        ref = x.double() @ w.T
        # float32 noise of the sum of |products| (the float kernel reaches ~1.3e-6 on the outlier rows: its f = 1 + q / 16
        # form cancels bits; one int8 level would be ~1e-3)
        bound = 3e-6 * (x.double().abs() @ w.abs().T)
        for flags in ({}, {"direct_only": True}):  # the split kernel (AVX2) and the float kernel
            err = (_run(kind, records, x, n, **flags).double() - ref).abs()
            assert (err <= bound).all(), f"{flags}: max error / bound {(err / bound).max().item():.3g}"


@requires_kernels
@pytest.mark.parametrize("fmt", FOUR_BIT)
@pytest.mark.parametrize("m", [1, 2, 3])
def test_int8_preset_rows_match_the_panel_kernel(fmt: str, m: int) -> None:
    """Up to 3 rows the preset runs the decode kernel; 4 copies of the rows run the panel kernel: same quantization,
    so the same integer sums (outputs equal to float32 rounding of the span sums)."""
    g = torch.Generator().manual_seed(2)
    n, k = 130, 512
    kind, records = pack_records([(fmt, make_blocks(fmt, n, k, seed=3))])
    x = torch.randn(m, k, generator=g)
    few = _run(kind, records, x, n, int8_activations=True)
    many = _run(kind, records, torch.cat([x] * 8), n, int8_activations=True)[:m]
    torch.testing.assert_close(few, many, rtol=1e-5, atol=1e-5 * many.abs().max().item())


@requires_kernels
@pytest.mark.parametrize("fmt", ["q8_0", "q6_k"])
@pytest.mark.parametrize("m", [1, 2])
def test_int8_preset_tile_rows_match_the_panel_kernel(fmt: str, m: int) -> None:
    """int8 tiles (Q8_0; Q6_K mixed into a fused layer) under the preset: the decode kernel's quads built in registers
    give the panel kernel's sums."""
    g = torch.Generator().manual_seed(4)
    n, k = 130, 512
    kind, records = pack_records([(fmt, make_blocks(fmt, n, k, seed=5)), ("q4_k", make_blocks("q4_k", 64, k, seed=6))])
    assert kind == "int8"
    x = torch.randn(m, k, generator=g)

    def run(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n + 64)
        kernels.gemv_int8(out, rows, records[0], records[1], None, records[2] if len(records) > 2 else None,
                          int8_activations=True)
        return out

    few, many = run(x), run(torch.cat([x] * 8))[:m]
    torch.testing.assert_close(few, many, rtol=1e-5, atol=1e-5 * many.abs().max().item())
