"""16-bit weight tiles (gemv_f16 / gemv_bf16 on float32 rows): F.linear on the widened weights, one summation order
per row on the direct path, the packer's layout, and the F16 / BF16 rows the greedy head screen rechecks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.layers.quantization.half_tiles import ROW_TYPES, pack_half_tiles, write_tile_rows
from tests.conftest import require_kernels, requires_kernels
from tests.kernels.conftest import assert_gemv_close

pytestmark = requires_kernels
DTYPES = [torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (17, 33), (130, 77), (576, 576), (1536, 576)]
MS = [1, 2, 3, 7, 16, 17, 40, 97]  # above 16: the fp32 panels (unless direct_only)


def _gemv(dtype: torch.dtype):
    kernels = require_kernels()
    return kernels.gemv_f16 if dtype == torch.float16 else kernels.gemv_bf16


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_half_tiles_are_f_linear_on_the_widened_weight(n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    bias = torch.randn(n, generator=g)
    tiles = pack_half_tiles(w)
    assert tiles.shape == (-(-n // 64), k, 64) and tiles.dtype == dtype
    for m in MS:
        x = torch.randn(m, k, generator=g)
        for b in (None, bias):
            out = torch.full((m, n), float("nan"))
            _gemv(dtype)(out, x, tiles, b)
            assert_gemv_close(out, F.linear(x, w.float(), b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_direct_only_sums_each_row_in_one_order_whatever_the_batch(dtype: torch.dtype) -> None:
    """The batch-invariant path: a row's outputs are bit for bit the same alone and among 1..97 rows."""
    g = torch.Generator().manual_seed(5)
    n, k = 200, 700  # K spans several fixed k blocks, and a partial one
    tiles = pack_half_tiles((torch.randn(n, k, generator=g) * 0.05).to(dtype))
    x = torch.randn(max(MS), k, generator=g)
    alone = torch.empty(max(MS), n)
    for i in range(max(MS)):
        _gemv(dtype)(alone[i:i + 1], x[i:i + 1], tiles, None, direct_only=True)
    for m in MS:
        out = torch.empty(m, n)
        _gemv(dtype)(out, x[:m], tiles, None, direct_only=True)
        assert torch.equal(out.view(torch.int32), alone[:m].view(torch.int32)), m


def test_tiles_written_in_parts_are_the_f16_packers_layout() -> None:
    """Parts at row offsets that straddle tiles (a fused q / k / v) land where pack_gemv_weight_f16 puts them."""
    kernels = require_kernels()
    w = (torch.randn(300, 96) * 0.1).half()
    tiles = torch.zeros(5, 96, 64, dtype=torch.float16)
    for start, stop in ((0, 37), (37, 64), (64, 200), (200, 300)):
        write_tile_rows(tiles, w[start:stop], start)
    assert torch.equal(tiles, kernels.pack_gemv_weight_f16(w.float()))
    assert torch.equal(pack_half_tiles(w), tiles)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tile_writer_takes_parts_at_any_offset_and_strided_rows(dtype: torch.dtype) -> None:
    """The loader writes parts at any offset, and row-strided views (a tensor-parallel column slice), where packing
    the whole weight puts them; rows beyond the tiles are refused."""
    w = torch.randn(333, 200, generator=torch.Generator().manual_seed(4)).to(dtype)
    want = pack_half_tiles(w)
    got = torch.zeros_like(want)
    for start, stop in ((0, 5), (5, 64), (64, 190), (190, 333)):
        write_tile_rows(got, w[start:stop], start)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    wide = torch.randn(70, 300).to(dtype)
    got = torch.zeros(2, 200, 64, dtype=dtype)
    write_tile_rows(got, wide[:, 50:250], 0)  # rows with a stride of 300
    assert torch.equal(got.view(torch.int16), pack_half_tiles(wide[:, 50:250].contiguous()).view(torch.int16))
    with pytest.raises(ValueError, match="beyond"):
        write_tile_rows(got, wide[:, :200], 100)


@pytest.mark.parametrize("dtype", DTYPES)
def test_f16_and_bf16_rows_are_the_widened_values(dtype: torch.dtype) -> None:
    kernels = require_kernels()
    w = torch.randn(70, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    w[3, :4] = torch.tensor([float("inf"), -0.0, 1e-7, 6e-8]).to(dtype)  # (subnormal in float16)
    blocks = w.view(torch.uint8).view(70, -1, 64)
    ids = torch.tensor([69, 3, 0, 3], dtype=torch.int64)
    out = torch.full((len(ids), 256), float("nan"))
    kernels.gguf_rows(out, blocks, ROW_TYPES[dtype], ids)
    assert torch.equal(out.view(torch.int32), w[ids].float().view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_screen_rechecks_a_16_bit_table_as_its_float32_widening(dtype: torch.dtype) -> None:
    """A 16-bit head's screen reads its candidates' rows from the row-major 16-bit table: the same logits and tokens,
    bit for bit, as from the widened float32 table."""
    kernels = require_kernels()
    w = (torch.randn(1000, 256, generator=torch.Generator().manual_seed(7)) * 0.05).to(dtype)
    table = w.float()
    q, scales, offsets, bounds = kernels.pack_head_screen(table)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1))
    results = []
    for source, ggml_type in ((table, 0), (w.view(torch.uint8).view(1000, -1, 64), ROW_TYPES[dtype])):
        out = torch.empty(9, 1000)
        tokens = torch.empty(9, dtype=torch.int64)
        kernels.head_screen(out, x, q, scales, offsets, source, bounds, tokens, table_ggml_type=ggml_type)
        results.append((out, tokens))
    assert torch.equal(results[0][0].view(torch.int32), results[1][0].view(torch.int32))
    assert torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][1], F.linear(x, table).argmax(dim=1))
