"""linear_dtype="int8": the records and int8-tile kernels with activations quantized per row and block of 32 (Q4_K
and Q6_K with VNNI: per super-block of 256).

On activations that the block quantization represents exactly (each block x = q * 2^-e with a code of +-127), the
integer products must give F.linear of the records' weights to float32 noise, for every format, row count (row
blocks, padding) and kernel variant; on Gaussian activations the error stays that of an 8-bit x."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.kernels.build import load_kernels
from pagemill.layers.quantization.gguf import pack_records
from pagemill.layers.quantization.gguf_records import BLOCK_LENGTHS, PLANE_LAYOUTS, RECORD_TYPES
from tests.conftest import requires_kernels
from tests.kernels.conftest import assert_gemv_close
from tests.kernels.gguf_blocks import dequantized, make_blocks
from tests.kernels.test_gguf_records import MIXED, unpack

kernels = load_kernels()
pytestmark = requires_kernels

FORMATS = [name for name, _, _ in RECORD_TYPES.values()]
MS = [1, 2, 3, 4, 7, 17, 64]  # register blocks of 1..3 rows, uneven splits, many row blocks per panel


def block_exact_x(m: int, k: int, seed: int) -> torch.Tensor:
    """x [m, k] whose int8 quantization per 32 and per 256 (the K-quants' super-blocks with VNNI) is exact: codes in
    [-127, 127], one +-127 per block of 32, one scale 2^-e per 256."""
    g = torch.Generator().manual_seed(seed)
    nb = (k + 255) // 256 * 8
    q = torch.randint(-127, 128, (m, nb * 32), generator=g).float()
    q.view(m, nb, 32)[:, :, 5] = 127.0 * (torch.randint(0, 2, (m, nb), generator=g).float() * 2 - 1)
    scale = torch.pow(2.0, -torch.randint(3, 12, (m, nb // 8, 1, 1), generator=g).float()).expand(m, nb // 8, 8, 1)
    return (q.view(m, nb // 8, 8, 32) * scale).reshape(m, -1)[:, :k].contiguous()


def gemv_i8(kind: str, records, x: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(x.shape[0], n)
    if kind == "int8":
        kernels.gemv_int8(out, x, records[0], records[1], bias, records[2] if len(records) > 2 else None,
                          int8_activations=True)
    else:
        kernels.gemv_records(out, x, records, PLANE_LAYOUTS[kind][3], bias, int8_activations=True)
    return out


def _shape(fmt: str) -> tuple[int, int]:
    return (130, 512) if BLOCK_LENGTHS[fmt] == 256 else (100, 96)


@pytest.mark.parametrize("fmt", FORMATS)
def test_integer_products_equal_float_linear_on_exact_activations(fmt: str) -> None:
    n, k = _shape(fmt)
    blocks = make_blocks(fmt, n, k, seed=7)
    kind, records = pack_records([(fmt, blocks)], kernels.isa())
    w = dequantized(fmt, blocks).view(n, k)
    bias = torch.randn(n)
    for m in MS:
        x = block_exact_x(m, k, seed=m)
        ref = F.linear(x.double(), w.double(), bias.double()).float()
        assert_gemv_close(gemv_i8(kind, records, x, n, bias), ref)


@pytest.mark.parametrize("formats,kind", MIXED)
def test_mixed_fused_parts_int8_tiles_with_mins(formats: tuple[str, ...], kind: str) -> None:
    k = 512
    parts = [(fmt, make_blocks(fmt, n, k, seed=n)) for fmt, n in zip(formats, (100, 30, 70))]
    got_kind, records = pack_records(parts)
    w = torch.cat([dequantized(fmt, b) for fmt, b in parts])
    for m in (1, 5, 33):
        x = block_exact_x(m, k, seed=m + 1)
        assert_gemv_close(gemv_i8(got_kind, records, x, w.shape[0], None), F.linear(x.double(), w.double()).float())


def test_padded_int8_tiles() -> None:
    """int8 tiles padded along K (K = 80 of Kp = 96): x's missing columns are zero codes."""
    w = torch.randn(70, 80)
    q, scales = kernels.pack_gemv_weight_int8(w, 32)
    wq = unpack("int8", [q, scales], 70, 80)
    x = block_exact_x(9, 80, seed=3)
    assert_gemv_close(gemv_i8("int8", [q, scales], x, 70, None), F.linear(x.double(), wq.double()).float())


@pytest.mark.parametrize("fmt", ["q4_k", "q4_1", "q8_0"])
def test_gaussian_activations_error_is_eight_bit(fmt: str) -> None:
    """On x ~ N(0, 1) the outputs differ from float by what 8-bit x costs: well under 2% of max |y|."""
    n, k = _shape(fmt)
    blocks = make_blocks(fmt, n, k, seed=11)
    kind, records = pack_records([(fmt, blocks)], kernels.isa())
    w = dequantized(fmt, blocks).view(n, k)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(0))
    ref = F.linear(x, w)
    err = (gemv_i8(kind, records, x, n, None) - ref).abs().max().item()
    assert 0 < err < 0.02 * ref.abs().max().item()


@pytest.mark.parametrize("fmt,rows,integer", [("q6_k", 64, True), ("q6_k", 4, True), ("q6_k", 3, True),
                                              ("q6_k", 1, True), ("q5_k", 64, False), ("q5_k", 1, False)])
def test_which_wider_records_take_integer_products(fmt: str, rows: int, integer: bool) -> None:
    """6-bit records multiply in integers at every row count where the variant has VNNI (AVX2 lays Q6_K out as int8
    tiles, which always do); 5-bit records stay on the float kernels (float32 noise only)."""
    n, k = 130, 512
    blocks = make_blocks(fmt, n, k, seed=3)
    kind, records = pack_records([(fmt, blocks)], kernels.isa())
    w = dequantized(fmt, blocks).view(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    ref = F.linear(x.double(), w.double()).float()
    err = (gemv_i8(kind, records, x, n, None) - ref).abs().max().item() / ref.abs().max().item()
    integer = kind == "int8" or (integer and kernels.isa() == "avx512_vbmi")
    assert (1e-4 < err < 0.02) if integer else err < 1e-5


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_super_block_decode_rows_equal_the_panel_rows(fmt: str) -> None:
    """Q4_K's and Q6_K's 1-3 row kernel (quads built in registers) gives each row the bits the panel path gives it in
    a batch, on tiles split between threads too (3 tiles on two threads). Only VNNI variants multiply these records
    with integer sub-scales over super-blocks (AVX2 lays Q6_K out as int8 tiles, whose 1-2 row kernel sums in another
    order, and takes Q4_K's float epilogue per group)."""
    if kernels.isa() != "avx512_vbmi":
        pytest.skip("integer super-block products on the VNNI variant only")
    n, k = 130, 512
    kind, records = pack_records([(fmt, make_blocks(fmt, n, k, seed=5))], kernels.isa())
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(6))
    full = gemv_i8(kind, records, x, n, None)
    for m0, m in [(0, 1), (5, 2), (9, 3), (39, 1)]:
        assert torch.equal(gemv_i8(kind, records, x[m0:m0 + m].contiguous(), n, None), full[m0:m0 + m]), (m0, m)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q4_1"])
def test_rows_do_not_depend_on_the_rows_beside_them(fmt: str) -> None:
    """A row's output bits are the same whatever rows share the call (above the decode kernel's 3 rows), whether its
    tile is one thread's or split by rows between threads (3 tiles: one left over on two threads)."""
    n, k = 130, 512
    kind, records = pack_records([(fmt, make_blocks(fmt, n, k, seed=3))], kernels.isa())
    x = torch.randn(120, k, generator=torch.Generator().manual_seed(4))
    full = gemv_i8(kind, records, x, n, None)
    for m0, m in [(0, 4), (7, 17), (50, 64), (3, 117)]:
        assert torch.equal(gemv_i8(kind, records, x[m0:m0 + m].contiguous(), n, None), full[m0:m0 + m]), (m0, m)
