"""GGUF records for every kept format: laid out from the file's blocks they hold exactly gguf.quants' dequantized
weights, and the GEMV kernels (direct and panel paths) compute F.linear of those weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.kernels.build import load_kernels
from pagemill.layers.quantization.gguf import pack_records
from pagemill.layers.quantization.gguf_records import (BLOCK_LENGTHS, FORMAT_KINDS, PLANE_LAYOUTS, RECORD_TYPES,
                                                       pack_int8, unpack_int8, unpack_planes)
from tests.conftest import requires_kernels
from tests.kernels.conftest import assert_gemv_close
from tests.kernels.gguf_blocks import dequantized, make_blocks

kernels = load_kernels()

FORMATS = [name for name, _, _ in RECORD_TYPES.values()]
MS = [1, 3, 16, 17, 64]  # direct kernels up to 16 rows, fp32 panels beyond


def unpack(kind: str, records, n: int, k: int) -> torch.Tensor:
    """The records' float32 weight."""
    return unpack_int8(records, n, k) if kind == "int8" else unpack_planes(kind, records, n)


def gemv(kind: str, records, x: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel for the record kind."""
    out = torch.empty(x.shape[0], n)
    if kind == "int8":
        kernels.gemv_int8(out, x, records[0], records[1], bias, records[2] if len(records) > 2 else None)
    else:
        kernels.gemv_records(out, x, records, PLANE_LAYOUTS[kind][3], bias)
    return out


def _shapes(fmt: str) -> list[tuple[int, int]]:
    return [(100, 512), (130, 256)] if BLOCK_LENGTHS[fmt] == 256 else [(100, 96), (130, 320)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_records_hold_the_dequantized_weights_bit_for_bit(fmt: str) -> None:
    for n, k in _shapes(fmt):
        blocks = make_blocks(fmt, n, k, seed=n + k)
        kind, records = pack_records([(fmt, blocks)])
        assert kind == FORMAT_KINDS[fmt]
        assert torch.equal(unpack(kind, records, n, k), dequantized(fmt, blocks).view(n, k))


@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_form_of_every_format_is_exact(fmt: str) -> None:
    """Every format's int8 tiles (used when a fused layer mixes record kinds) hold the same weights."""
    n, k = _shapes(fmt)[0]
    blocks = make_blocks(fmt, n, k, seed=3)
    assert torch.equal(unpack_int8(pack_int8([(fmt, blocks)]), n, k), dequantized(fmt, blocks))


# Fused layers whose parts mix formats (rows 100 + 30 + 70: parts straddle GEMV tiles): (parts, record kind).
MIXED = [(("q5_0", "q8_0", "q6_k"), "int8"), (("q4_0", "q4_1", "q4_0"), "q4"), (("q4_k", "q5_0", "q2_k"), "int8"),
         (("q4_k", "q4_k", "q4_k"), "q4k"), (("q5_1", "q5_0", "q5_1"), "q5"), (("q6_k", "q6_k", "q6_k"), "q6k")]


@pytest.mark.parametrize("formats,kind", MIXED)
def test_mixed_fused_parts(formats: tuple[str, ...], kind: str) -> None:
    k = 512
    parts = [(fmt, make_blocks(fmt, n, k, seed=n)) for fmt, n in zip(formats, (100, 30, 70))]
    got_kind, records = pack_records(parts)
    w = torch.cat([dequantized(fmt, b) for fmt, b in parts])
    assert got_kind == kind
    assert torch.equal(unpack(kind, records, w.shape[0], k), w)
    if kernels is not None:
        g = torch.Generator().manual_seed(1)
        for m in (1, 17):
            x = torch.randn(m, k, generator=g)
            assert_gemv_close(gemv(kind, records, x, w.shape[0], None), F.linear(x.double(), w.double()).float())


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0"])
def test_m_beyond_fp16_goes_to_int8_tiles(fmt: str) -> None:
    blocks = make_blocks(fmt, 64, 64, seed=1).clone()
    blocks[3, 1, 0:2] = torch.tensor([10000.0], dtype=torch.float16).view(torch.uint8)  # -8 d / -16 d overflow fp16
    kind, records = pack_records([(fmt, blocks)])
    assert kind == "int8"
    assert torch.equal(unpack(kind, records, 64, 64), dequantized(fmt, blocks))


@requires_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_matches_linear_on_the_dequantized_weights(fmt: str) -> None:
    g = torch.Generator().manual_seed(0)
    for n, k in _shapes(fmt):
        blocks = make_blocks(fmt, n, k, seed=n * k)
        kind, records = pack_records([(fmt, blocks)])
        w = dequantized(fmt, blocks).view(n, k).double()
        for m in MS:
            for bias in (None, torch.randn(n, generator=g)):
                x = torch.randn(m, k, generator=g)
                ref = F.linear(x.double(), w, None if bias is None else bias.double()).float()
                assert_gemv_close(gemv(kind, records, x, n, bias), ref)


@requires_kernels
@pytest.mark.parametrize("fmt", ["q4_1", "q5_1", "q4_k", "q5_k", "q6_k", "q2_k", "q3_k"])
def test_split_unit_unpack_gives_the_same_bits(fmt: str) -> None:
    """The one-row kernel's unpack for split 512-bit units (Zen 4) computes the same floats in the same order as the
    byte-permute unpack, whichever the CPU (variants without it ignore the setting)."""
    n, k = _shapes(fmt)[0]
    blocks = make_blocks(fmt, n, k, seed=7)
    kind, records = pack_records([(fmt, blocks)])
    w = dequantized(fmt, blocks).view(n, k).double()
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2))
    detected = kernels.split_zmm_units()
    try:
        outs = []
        for on in (False, True):
            kernels.set_split_zmm_units(on)
            outs.append(gemv(kind, records, x, n, None))
    finally:
        kernels.set_split_zmm_units(detected)
    assert torch.equal(outs[0], outs[1])
    assert_gemv_close(outs[1], F.linear(x.double(), w).float())
