"""GGUF rows decoded straight from the file's blocks (csrc/cpu/gguf_rows.cpp): gguf.quants' float32 values bit for bit,
for every kept block format; and the greedy head screen rechecking its candidates from such blocks."""

from __future__ import annotations

import pytest
import torch

from pagemill.layers.quantization.gguf_records import RECORD_TYPES
from tests.conftest import require_kernels, requires_kernels
from tests.kernels.gguf_blocks import dequantized, make_blocks

pytestmark = requires_kernels
FORMATS = {name: ggml_type for ggml_type, (name, _, _) in RECORD_TYPES.items()}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_rows_equal_gguf_dequantize_bit_for_bit(fmt):
    kernels = require_kernels()
    blocks = make_blocks(fmt, 70, 512, seed=3)
    ref = dequantized(fmt, blocks)
    ids = torch.tensor([69, 0, 5, 5, 33], dtype=torch.int64)
    out = torch.full((len(ids), 512), float("nan"))
    kernels.gguf_rows(out, blocks, FORMATS[fmt], ids)
    assert torch.equal(out.view(torch.int32), ref[ids].view(torch.int32))
    flat = torch.empty(70, 512)  # [N, row bytes] rows, and every id at once
    kernels.gguf_rows(flat, blocks.reshape(70, -1), FORMATS[fmt], torch.arange(70))
    assert torch.equal(flat.view(torch.int32), ref.view(torch.int32))


def test_bad_ids_and_shapes_are_refused():
    kernels = require_kernels()
    blocks = make_blocks("q8_0", 8, 64, seed=0)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.gguf_rows(torch.empty(1, 64), blocks, FORMATS["q8_0"], torch.tensor([8]))
    with pytest.raises(RuntimeError, match="do not hold"):
        kernels.gguf_rows(torch.empty(1, 96), blocks, FORMATS["q8_0"], torch.tensor([0]))
    with pytest.raises(RuntimeError, match="not a block format"):
        kernels.gguf_rows(torch.empty(1, 64), blocks, 0, torch.tensor([0]))  # F32: read as floats, not rows


@pytest.mark.parametrize("fmt", ["q8_0", "q6_k", "q4_k"])
def test_head_screen_rechecks_from_blocks_as_from_the_float_table(fmt):
    """A quantized head's screen reads its candidates' rows from the blocks: the same logits, bit for bit, as the
    screen over the dequantized float32 table."""
    kernels = require_kernels()
    blocks = make_blocks(fmt, 1000, 256, seed=7)
    table = dequantized(fmt, blocks)
    q, scales, offsets, bounds = kernels.pack_head_screen(table)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1))
    x[4] = float("nan")  # a non-finite row is recomputed whole
    outs, counts = [], []
    for source, ggml_type in ((table, 0), (blocks, FORMATS[fmt])):
        out = torch.empty(9, 1000)
        tokens = torch.empty(9, dtype=torch.int64)
        counts.append(kernels.head_screen(out, x, q, scales, offsets, source, bounds, tokens,
                                          table_ggml_type=ggml_type))
        outs.append((out, tokens))
    assert counts[0] == counts[1] >= 1000
    assert torch.equal(outs[0][0].view(torch.int32), outs[1][0].view(torch.int32))
    assert torch.equal(outs[0][1], outs[1][1])
    finite = torch.arange(9) != 4
    assert torch.equal(outs[1][1][finite], (x[finite].double() @ table.double().t()).argmax(1))
