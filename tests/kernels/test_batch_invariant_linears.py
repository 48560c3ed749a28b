"""Batch-invariant linears (layers/batch_invariant.py): a row's output bits do not depend on how many rows are
multiplied with it nor on its place among them, on every path (gemv_f32 for float32 weights, the records GEMV for
int8 / int4 / GGUF records), and they stay F.linear of the layer's weight within float32 noise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.kernels.build import load_kernels
from pagemill.kernels.ops import KernelLayerOps
from pagemill.layers.batch_invariant import make_batch_invariant, pack_f32_tiles
from pagemill.layers.linear import ColumnParallelLinear
from pagemill.layers.quantization.gguf import pack_records
from pagemill.layers.quantization.gguf_records import BLOCK_LENGTHS, PLANE_LAYOUTS, RECORD_TYPES
from tests.conftest import requires_kernels
from tests.kernels.conftest import assert_gemv_close
from tests.kernels.gguf_blocks import dequantized, make_blocks
from tests.layers.helpers import layer_context

kernels = load_kernels()
pytestmark = requires_kernels

# Non-multiples of 16 / 64 / 256 in N and K, then SmolLM2's qkv and down projections.
SHAPES = [(1, 1), (17, 33), (130, 300), (960, 576), (576, 1536)]
# Row counts across every switch of the default paths: GEMV sizes, 16 (direct / panels), 64 (panels / oneDNN).
MS = [1, 2, 3, 4, 5, 7, 16, 17, 31, 64, 65, 100]


def _row_everywhere(fn, x: torch.Tensor, target: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
    """fn's output row for `target` placed first, in the middle and last among M - 1 rows of x, for every M."""
    outs = {}
    for m in MS:
        for pos in sorted({0, m // 2, m - 1}):
            rows = torch.cat([x[:pos], target[None], x[pos:m - 1]])
            outs[(m, pos)] = fn(rows)[pos]
    return outs


def _assert_invariant(fn, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, target = torch.randn(max(MS), k, generator=g), torch.randn(k, generator=g)
    outs = _row_everywhere(fn, x, target)
    ref = outs[(1, 0)]
    differ = [key for key, out in outs.items() if not torch.equal(out, ref)]
    assert not differ, f"the row's output changed with (rows, position) {differ}"
    return ref


@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_f32_matches_f_linear(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, bias = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)
    packed = pack_f32_tiles(w)
    assert packed.shape == (-(-n // 64), k, 64)
    for m in (1, 5, 16, 17, 40):
        x = torch.randn(m, k, generator=g)
        for b in (None, bias):
            out = torch.full((m, n), float("nan"))
            kernels.gemv_f32(out, x, packed, b)
            assert_gemv_close(out, F.linear(x, w, b))


@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_f32_rows_do_not_depend_on_the_batch(n: int, k: int) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05
    packed = pack_f32_tiles(w)

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], n)
        kernels.gemv_f32(out, x, packed, None)
        return out

    _assert_invariant(fn, k, seed=n)


@pytest.mark.parametrize("fmt", [name for name, _, _ in RECORD_TYPES.values()])
def test_records_direct_only_rows_do_not_depend_on_the_batch(fmt: str) -> None:
    """Every GGUF record format (bit-plane records and int8 tiles) with direct_only: batch-independent rows, still
    F.linear of the file's dequantized weight."""
    n, k = (130, 512) if BLOCK_LENGTHS[fmt] == 256 else (130, 320)
    blocks = make_blocks(fmt, n, k, seed=5)
    kind, records = pack_records([(fmt, blocks)])

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], n)
        if kind == "int8":
            kernels.gemv_int8(out, x, records[0], records[1], None, records[2] if len(records) > 2 else None,
                              direct_only=True)
        else:
            kernels.gemv_records(out, x, records, PLANE_LAYOUTS[kind][3], None, direct_only=True)
        return out

    _assert_invariant(fn, k, seed=n)
    x = torch.randn(40, k)
    assert_gemv_close(fn(x), F.linear(x, dequantized(fmt, blocks).view(n, k)))


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_layers_rows_do_not_depend_on_the_batch(quantization: str, bias: bool) -> None:
    """float32 (gemv_f32), int8 tiles (gemv_int8 with mins) and int4 records (gemv_records) layers."""
    n, k = 200, 576
    torch.manual_seed(0)
    layer = ColumnParallelLinear(k, n, bias, layer_context(quantization=quantization), "x")
    weight = torch.randn(n, k) * 0.05
    layer.load_weight("weight", weight)
    if bias:
        layer.load_weight("bias", torch.randn(n))
    layer.process_weights_after_loading()
    default = layer.quant_method.dequantized_weight(layer).clone()
    assert make_batch_invariant(layer, KernelLayerOps(kernels)) == 1
    ref = _assert_invariant(layer, k, seed=1)
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(max(MS), k, generator=g), torch.randn(k, generator=g)
    assert torch.equal(ref, layer(target[None])[0])
    assert_gemv_close(layer(torch.cat([x, target[None]])),
                      F.linear(torch.cat([x, target[None]]), default, layer.bias))
