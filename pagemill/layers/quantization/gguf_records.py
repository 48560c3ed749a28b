"""GGUF blocks -> the GEMV kernels' records, by bit rearrangement only (csrc/cpu/variant/gemv.cpp has the layouts).

Each supported ggml type is read into the codes and per-group scales its dequantization multiplies
(`gguf.quants.dequantize`: the codes are small integers, the scales fp16 values or exact fp32 products of an fp16
and a small integer), then laid out as one record kind:

- bit-plane records (gemv_records), w = d q + m with B-bit codes (a nibble plane, B - 4 high-bit planes):
  "q4" Q4_0 / Q4_1 and "q5" Q5_0 / Q5_1 (fp16 d, m per 32; Q4_0 / Q5_0 with m = -8 d / -16 d, exact in fp16),
  "q4k" / "q5k" Q4_K / Q5_K (the fp16 D / Dmin of each 256 and the 6-bit sc / mn of each 32, as stored),
  "q6k" Q6_K (fp16 D per 256, int8 sc per 16, m = -32 D sc), and in 4-bit records the 2/3-bit codes of
  "q2k" Q2_K (Q4_K's scales over 16 groups of 16) and "q3k" Q3_K (as Q6_K with m = -4 D sc);
- "int8": int8 tiles with fp32 scales (and mins) per group of 16 or 32 (Q8_0; IQ4_NL / IQ4_XS, whose 4-bit
  indices pick int8 values from a table: w = d kvalues[i], IQ4_XS with d = D (ls - 32) per 32); every format has
  an int8 form, so a fused layer whose parts mix record kinds gets int8 tiles too.

`unpack_*` turn records back into float32 weights with gguf.quants' arithmetic, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import torch

GEMV_TILE = 64  # output channels per packed GEMV tile
QK_K = 256  # K-quant super-block length
_CHUNK_ROWS = 64 * GEMV_TILE  # rows decoded at a time: bounds the temporaries of large tensors

# ggml type -> (format name, record kind, elements per block)
RECORD_TYPES: dict[int, tuple[str, str, int]] = {
    2: ("q4_0", "q4", 32), 3: ("q4_1", "q4", 32), 6: ("q5_0", "q5", 32), 7: ("q5_1", "q5", 32),
    8: ("q8_0", "int8", 32), 10: ("q2_k", "q2k", QK_K), 11: ("q3_k", "q3k", QK_K), 12: ("q4_k", "q4k", QK_K),
    13: ("q5_k", "q5k", QK_K), 14: ("q6_k", "q6k", QK_K), 20: ("iq4_nl", "int8", 32), 23: ("iq4_xs", "int8", QK_K),
}
# IQ4_NL / IQ4_XS: 4-bit indices into this table of int8 values (ggml's kvalues_iq4nl), so their int8 form is exact
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# bit-plane kind -> (code bits, groups per record, group length, gemv_records' format name)
PLANE_LAYOUTS: dict[str, tuple[int, int, int, str]] = {
    "q4": (4, 1, 32, "q4_1"), "q5": (5, 1, 32, "q5_1"), "q4k": (4, 8, 32, "q4_k"), "q5k": (5, 8, 32, "q5_k"),
    "q6k": (6, 16, 16, "q6_k"), "q2k": (4, 16, 16, "q2_k"), "q3k": (4, 16, 16, "q3_k"),
}
FORMAT_KINDS = {name: kind for name, kind, _ in RECORD_TYPES.values()}
# 6-bit codes come out of their two high-bit planes at memory speed only with AVX-512 VBMI + GFNI byte permutes;
# AVX2 spends ~2.2 uops per weight on them (a Q6_K layer of Llama-3.2-1B: 5.7 GB/s on a Zen 3, 7 G weights/s),
# while int8 tiles of the same exact values (w = D sc (q - 32): int8 codes, fp32 d = D sc per 16) stream at ~24 GB/s
# there (19 G weights/s) for 1.25 bytes per weight instead of 0.82. Other variants lay Q6_K out as int8 tiles.
SLOW_PLANE_KINDS = frozenset({"q6k"})
FAST_PLANE_ISAS = frozenset({"avx512_vbmi"})
BLOCK_LENGTHS = {name: bs for name, _, bs in RECORD_TYPES.values()}


@dataclass
class Int8Codes:
    """Weights q * scale (+ min) per group of `group` along K: q int8 [N, K], scale / min float32 [N, K / group]."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    group: int


def _f16(b: torch.Tensor) -> torch.Tensor:
    """fp16 values of the last axis' byte pairs, as float32 (exact)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2, n]: low nibbles, then high nibbles."""
    return torch.stack((qs & 15, qs >> 4), dim=-2)


def _bits(b: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """[..., n] bytes -> [..., len(shifts), n]: (b >> s) & mask for each shift."""
    return torch.stack([(b >> s) & mask for s in shifts], dim=-2)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> 6-bit sc, mn [..., 8] (gguf.quants.Q4_K.get_scale_min)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 scale bytes [n, nb, 12] -> the 16 signed 6-bit scales int8 [n, nb, 16] (sc - 32)."""
    n, nb = s.shape[:2]
    low = _nibbles(s[..., 0:8]).reshape(n, nb, 16)
    high = _bits(s[..., 8:12], [0, 2, 4, 6], 3).reshape(n, nb, 16)
    return (low | (high << 4)).to(torch.int8) - 32


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's 4 high-bit bytes [..., 4] (a little-endian uint32) -> bit i of element i [..., 32]."""
    return _bits(qh, list(range(8)), 1).transpose(-1, -2).reshape(*qh.shape[:-1], 32)


# IQ4 byte -> its two int8 values [2, 256]: the low nibble's, then the high one's
_IQ4_BYTE_VALUES = torch.tensor(IQ4_VALUES, dtype=torch.int8)[torch.stack((torch.arange(256) & 15,
                                                                           torch.arange(256) >> 4))]


def _iq4_codes(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes of IQ4 indices -> the table's values int8 [..., 2, 16]: element j is byte j's low nibble,
    j + 16 its high one (`_nibbles` order; one lookup per byte)."""
    return _IQ4_BYTE_VALUES[:, qs.long()].movedim(0, -2)


def int8_codes(fmt: str, b: torch.Tensor) -> Int8Codes:
    """The int8 codes and group scales / mins of blocks uint8 [N, nb, bytes] of any kept format (Q8_0's records, and
    every format's int8 form for fused layers that mix record kinds)."""
    n, nb = b.shape[:2]
    if fmt == "q8_0":
        return Int8Codes(b[..., 2:].contiguous().view(torch.int8).reshape(n, -1), _f16(b[..., :2]).view(n, nb),
                         None, 32)
    if fmt == "q4_0":  # nibble records hold it, unless -8 d overflows fp16 or a fused layer mixes kinds
        q = _nibbles(b[..., 2:]).reshape(n, -1).to(torch.int8) - 8
        return Int8Codes(q, _f16(b[..., :2]).view(n, nb), None, 32)
    if fmt == "q4_1":
        q = _nibbles(b[..., 4:]).reshape(n, -1).to(torch.int8)
        return Int8Codes(q, _f16(b[..., :2]).view(n, nb), _f16(b[..., 2:4]).view(n, nb), 32)
    if fmt == "q4_k":
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scale_min(b[..., 4:16])
        q = _nibbles(b[..., 16:].reshape(n, nb, 4, 32)).reshape(n, -1).to(torch.int8)
        return Int8Codes(q, (d * sc.float()).view(n, -1), (-(dmin * mn.float())).view(n, -1), 32)
    if fmt in ("q5_0", "q5_1"):
        o = 2 if fmt == "q5_0" else 4
        low = _nibbles(b[..., o + 4:]).reshape(n, nb, 32)
        q = (low | (_q5_high(b[..., o:o + 4]) << 4)).to(torch.int8)
        if fmt == "q5_0":
            return Int8Codes((q - 16).reshape(n, -1), _f16(b[..., :2]).view(n, nb), None, 32)
        return Int8Codes(q.reshape(n, -1), _f16(b[..., :2]).view(n, nb), _f16(b[..., 2:4]).view(n, nb), 32)
    if fmt == "q5_k":
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scale_min(b[..., 4:16])
        qh = _bits(b[..., 16:48], list(range(8)), 1)  # [n, nb, 8, 32]: sub-block j takes bit j
        low = _nibbles(b[..., 48:].reshape(n, nb, 4, 32)).reshape(n, nb, 8, 32)
        q = (low | (qh << 4)).to(torch.int8)
        return Int8Codes(q.reshape(n, -1), (d * sc.float()).view(n, -1), (-(dmin * mn.float())).view(n, -1), 32)
    if fmt == "q6_k":
        low = _nibbles(b[..., :128].reshape(n, nb, 2, 64)).reshape(n, nb, 8, 32)
        high = _bits(b[..., 128:192].reshape(n, nb, 2, 32), [0, 2, 4, 6], 3).reshape(n, nb, 8, 32)
        q = (low | (high << 4)).to(torch.int8) - 32
        scale = _f16(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()
        return Int8Codes(q.reshape(n, -1), scale.view(n, -1), None, 16)
    if fmt == "q3_k":
        low = _bits(b[..., 32:96].reshape(n, nb, 2, 32), [0, 2, 4, 6], 3).reshape(n, nb, 16, 16)
        high = _bits(b[..., 0:32], list(range(8)), 1).reshape(n, nb, 16, 16)
        q = low.to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)
        sc = _q3_k_scales(b[..., 96:108])
        return Int8Codes(q.reshape(n, -1), (_f16(b[..., 108:110]) * sc.float()).view(n, -1), None, 16)
    if fmt == "q2_k":
        s = b[..., 0:16]
        q = _bits(b[..., 16:80].reshape(n, nb, 2, 32), [0, 2, 4, 6], 3).reshape(n, -1).to(torch.int8)
        scale = _f16(b[..., 80:82]) * (s & 15).float()
        mins = -(_f16(b[..., 82:84]) * (s >> 4).float())
        return Int8Codes(q, scale.view(n, -1), mins.view(n, -1), 16)
    if fmt == "iq4_nl":  # d fp16, then 16 bytes of indices
        return Int8Codes(_iq4_codes(b[..., 2:]).reshape(n, -1), _f16(b[..., :2]).view(n, nb), None, 32)
    if fmt == "iq4_xs":  # d fp16, scales_h uint16 (2 bits per 32), scales_l 4 bytes (4 bits per 32), 8 x 16 bytes
        high = _bits(b[..., 2:4], [0, 2, 4, 6], 3).transpose(-1, -2).reshape(n, nb, 8)  # little-endian: byte 0 has 0..3
        ls = (_nibbles(b[..., 4:8]).transpose(-1, -2).reshape(n, nb, 8) | (high << 4)).to(torch.int8) - 32
        q = _iq4_codes(b[..., 8:].reshape(n, nb, 8, 16)).reshape(n, -1)
        return Int8Codes(q, (_f16(b[..., :2]) * ls.float()).view(n, -1), None, 32)
    raise ValueError(f"{fmt} is not an int8-record GGUF format")


def _fp16_bits(b: torch.Tensor) -> torch.Tensor:
    """The fp16 values of the last axis' byte pairs (as stored)."""
    return b.contiguous().view(torch.float16)


def _k_planes(b: torch.Tensor, bits: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Q4_K / Q5_K blocks -> (codes [n, nb, 8, 32], scale section parts: D|Dmin fp16 [n, nb, 2], sc, mn [n, nb, 8])."""
    n, nb = b.shape[:2]
    o = 16 if bits == 4 else 48
    q = _nibbles(b[..., o:].reshape(n, nb, 4, 32)).reshape(n, nb, 8, 32)  # sub-block 2j: low, 2j + 1: high
    if bits == 5:
        q = q | (_bits(b[..., 16:48], list(range(8)), 1) << 4)  # sub-block j takes bit j
    sc, mn = _k_scale_min(b[..., 4:16])
    return q, [_fp16_bits(b[..., 0:4]), sc, mn]


def plane_codes(fmt: str, b: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """Blocks [n, nb, bytes] of a bit-plane format -> (codes uint8 [n, nb, groups per record, group length], the
    record's scale section as per-channel parts [n, nb, ...]); None for a Q4_0 / Q5_0 whose m overflows fp16."""
    n, nb = b.shape[:2]
    if fmt in ("q4_0", "q5_0"):
        o = 2 if fmt == "q4_0" else 6
        q = _nibbles(b[..., o:]).reshape(n, nb, 1, 32)
        if fmt == "q5_0":
            q = q | (_q5_high(b[..., 2:6]).view(n, nb, 1, 32) << 4)
        d = _fp16_bits(b[..., 0:2])
        m = (d.float() * (-8 if fmt == "q4_0" else -16)).half()  # exact unless it overflows
        return None if not torch.isfinite(m).all() else (q, [torch.cat((d, m), dim=-1)])
    if fmt in ("q4_1", "q5_1"):
        o = 4 if fmt == "q4_1" else 8
        q = _nibbles(b[..., o:]).reshape(n, nb, 1, 32)
        if fmt == "q5_1":
            q = q | (_q5_high(b[..., 4:8]).view(n, nb, 1, 32) << 4)
        return q, [_fp16_bits(b[..., 0:4])]
    if fmt in ("q4_k", "q5_k"):
        return _k_planes(b, 4 if fmt == "q4_k" else 5)
    if fmt == "q6_k":
        low = _nibbles(b[..., :128].reshape(n, nb, 2, 64)).reshape(n, nb, 8, 32)
        high = _bits(b[..., 128:192].reshape(n, nb, 2, 32), [0, 2, 4, 6], 3).reshape(n, nb, 8, 32)
        q = (low | (high << 4)).reshape(n, nb, 16, 16)
        return q, [_fp16_bits(b[..., 208:210]), b[..., 192:208].contiguous().view(torch.int8)]
    if fmt == "q2_k":
        q = _bits(b[..., 16:80].reshape(n, nb, 2, 32), [0, 2, 4, 6], 3).reshape(n, nb, 16, 16)
        s = b[..., 0:16]
        return q, [_fp16_bits(b[..., 80:84]), s & 15, s >> 4]
    if fmt == "q3_k":
        low = _bits(b[..., 32:96].reshape(n, nb, 2, 32), [0, 2, 4, 6], 3).reshape(n, nb, 16, 16)
        high = _bits(b[..., 0:32], list(range(8)), 1).reshape(n, nb, 16, 16)
        return low | (high << 2), [_fp16_bits(b[..., 108:110]), _q3_k_scales(b[..., 96:108])]  # code = q + 4
    raise ValueError(f"{fmt} is not a bit-plane GGUF format")


def _plane_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [n, nb, GR, G] -> each group's rows [n, nb, GR * (G / 2 + (bits - 4) G / 8)]: pair rows of low nibbles,
    then per high bit h the plane rows (bit j of row r = bit 4 + h of code 8r + j)."""
    n, nb, gr, g = q.shape
    rows = [(q[..., 0::2] & 15) | ((q[..., 1::2] & 15) << 4)]
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)
    for h in range(bits - 4):
        b = ((q >> (4 + h)) & 1).view(n, nb, gr, g // 8, 8)
        rows.append((b * weights).sum(-1, dtype=torch.uint8))  # distinct bits: the sum is the or
    return torch.cat(rows, dim=-1).view(n, nb, -1)


def _tiles(x: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N / 64, ..., 64] (channel last, N a multiple of 64)."""
    t = x.view(x.shape[0] // GEMV_TILE, GEMV_TILE, *x.shape[1:])
    return t.permute(0, *range(2, t.dim()), 1)


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x with zero rows appended up to a whole number of GEMV tiles."""
    pad = (-x.shape[0]) % GEMV_TILE
    return x if pad == 0 else torch.cat((x, x.new_zeros((pad, *x.shape[1:]))))


def record_kind(formats: set[str], isa: str | None = None) -> str:
    """The record kind of a layer whose parts have these formats: their shared kind, else int8 tiles; int8 tiles
    too for a kind whose planes the kernel variant `isa` unpacks slowly (None: the shared kind regardless)."""
    kinds = {FORMAT_KINDS[f] for f in formats}
    kind = kinds.pop() if len(kinds) == 1 else "int8"
    if kind in SLOW_PLANE_KINDS and isa is not None and isa not in FAST_PLANE_ISAS:
        return "int8"
    return kind


def kind_runs(parts: list[tuple[str, torch.Tensor]], isa: str | None = None) -> list[list[tuple[str, torch.Tensor]]]:
    """A layer's parts (format, blocks), rows in order, split into runs of consecutive parts of one record kind
    (each run is laid out as its own records: a fused layer mixing Q4_K and Q6_K streams 4.5 and 6.6 bits per weight,
    not int8 tiles' 8+)."""
    return [list(run) for _, run in groupby(parts, key=lambda part: record_kind({part[0]}, isa))]


def _regroup(c: Int8Codes, group: int, with_min: bool) -> Int8Codes:
    """The codes with scales (and mins, zeros where the format has none) repeated down to `group` (exact)."""
    r = c.group // group
    scale = c.scale.repeat_interleave(r, dim=1) if r > 1 else c.scale
    mins = None
    if with_min:
        mins = torch.zeros_like(scale) if c.min is None else c.min.repeat_interleave(r, dim=1) if r > 1 else c.min
    return Int8Codes(c.q, scale, mins, group)


def pack_int8(parts: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """gemv_int8's [q int8 [T, K, 64], scales fp32 [T, K / G, 64]] (+ mins, same shape) from the blocks
    [N_i, nb_i, bytes] of a layer's parts (rows in order); G is the parts' smallest group."""
    probes = [int8_codes(fmt, b[:1]) for fmt, b in parts]
    group, with_min = min(p.group for p in probes), any(p.min is not None for p in probes)
    n, k = sum(b.shape[0] for _, b in parts), probes[0].q.shape[1]
    if len({fmt for fmt, _ in parts}) == 1:  # one format: decode straight from the blocks, a chunk at a time
        fmt = parts[0][0]
        blocks = parts[0][1] if len(parts) == 1 else torch.cat([b for _, b in parts])
        chunks = (int8_codes(fmt, blocks[r0:r0 + _CHUNK_ROWS]) for r0 in range(0, n, _CHUNK_ROWS))
    else:
        codes = [_regroup(int8_codes(fmt, b), group, with_min) for fmt, b in parts]
        whole = Int8Codes(torch.cat([c.q for c in codes]), torch.cat([c.scale for c in codes]),
                          torch.cat([c.min for c in codes]) if with_min else None, group)
        chunks = (Int8Codes(whole.q[r0:r0 + _CHUNK_ROWS], whole.scale[r0:r0 + _CHUNK_ROWS],
                            None if whole.min is None else whole.min[r0:r0 + _CHUNK_ROWS], group)
                  for r0 in range(0, n, _CHUNK_ROWS))
    t = -(-n // GEMV_TILE)
    q = torch.zeros(t, k, GEMV_TILE, dtype=torch.int8)
    scales = torch.zeros(t, k // group, GEMV_TILE)
    mins = torch.zeros(t, k // group, GEMV_TILE) if with_min else None
    for i, c in enumerate(chunks):
        c = _regroup(c, group, with_min)
        t0 = i * _CHUNK_ROWS // GEMV_TILE
        t1 = t0 + -(-c.q.shape[0] // GEMV_TILE)
        q[t0:t1] = _tiles(_pad_rows(c.q))
        scales[t0:t1] = _tiles(_pad_rows(c.scale))
        if mins is not None:
            mins[t0:t1] = _tiles(_pad_rows(c.min))
    return [q, scales] if mins is None else [q, scales, mins]


def _part_rows(parts: list[tuple[str, torch.Tensor]], r0: int, r1: int) -> list[tuple[str, torch.Tensor]]:
    """The blocks of rows [r0, r1) of a layer whose parts (format, blocks) are stacked in order."""
    out, off = [], 0
    for fmt, b in parts:
        a, e = max(r0, off), min(r1, off + b.shape[0])
        if a < e:
            out.append((fmt, b[a - off:e - off]))
        off += b.shape[0]
    return out


def pack_planes(kind: str, parts: list[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
    """gemv_records' records [T, K / (GR G), R] of a bit-plane kind from a layer's parts (format, blocks), rows in
    order; None where a Q4_0 / Q5_0 m overflows fp16."""
    bits, gr, g, _ = PLANE_LAYOUTS[kind]
    n = sum(b.shape[0] for _, b in parts)
    out = None
    for r0 in range(0, n, _CHUNK_ROWS):
        decoded = [plane_codes(fmt, b) for fmt, b in _part_rows(parts, r0, r0 + _CHUNK_ROWS)]
        if any(d is None for d in decoded):
            return None
        q = _pad_rows(torch.cat([d[0] for d in decoded]))
        scale_parts = [_pad_rows(torch.cat([d[1][i] for d in decoded])) for i in range(len(decoded[0][1]))]
        t, nrec = q.shape[0] // GEMV_TILE, q.shape[1]
        pieces = [_tiles(_plane_rows(q, bits)).reshape(t, nrec, -1)]
        pieces += [_tiles(p).contiguous().view(torch.uint8).reshape(t, nrec, -1) for p in scale_parts]
        chunk = torch.cat(pieces, dim=2)
        if out is None:
            out = torch.empty(-(-n // GEMV_TILE), nrec, chunk.shape[2], dtype=torch.uint8)
        out[r0 // GEMV_TILE:r0 // GEMV_TILE + t] = chunk
    return out


def unpack_planes(kind: str, packed: torch.Tensor, rows: int) -> torch.Tensor:
    """The float32 weight [rows, K] of bit-plane records, with gguf.quants' arithmetic: (d * q) + m (Q4_0 / Q4_1 /
    Q5_0 / Q5_1), (D sc) q - (Dmin mn) (Q4_K / Q5_K / Q2_K), (D sc) (q - 32) (Q6_K), (D sc) (q - 4) (Q3_K)."""
    bits, gr, g, _ = PLANE_LAYOUTS[kind]
    t, nrec, _ = packed.shape
    per_group = g // 2 + (bits - 4) * (g // 8)
    body = packed[..., :gr * per_group * GEMV_TILE].reshape(t, nrec, gr, per_group, GEMV_TILE)
    pairs = body[:, :, :, :g // 2]
    q = torch.stack((pairs & 15, pairs >> 4), dim=4).reshape(t, nrec, gr, g, GEMV_TILE)
    for h in range(bits - 4):
        plane = body[:, :, :, g // 2 + h * (g // 8):g // 2 + (h + 1) * (g // 8)]
        q = q | (torch.stack([(plane >> j) & 1 for j in range(8)], dim=4).reshape(q.shape) << (4 + h))
    q = q.float()
    s = packed[..., gr * per_group * GEMV_TILE:].contiguous()
    if kind in ("q4", "q5"):
        dm = s.view(torch.float16).view(t, nrec, 2, 1, 1, GEMV_TILE).float()
        w = (dm[:, :, 0] * q).add_(dm[:, :, 1])
    elif kind in ("q4k", "q5k", "q2k"):
        dd = s[..., :4 * GEMV_TILE].contiguous().view(torch.float16).view(t, nrec, 2, 1, 1, GEMV_TILE).float()
        sc = s[..., 4 * GEMV_TILE:].reshape(t, nrec, 2, gr, 1, GEMV_TILE).float()
        w = (dd[:, :, 0] * sc[:, :, 0]) * q - dd[:, :, 1] * sc[:, :, 1]
    else:
        d = s[..., :2 * GEMV_TILE].contiguous().view(torch.float16).view(t, nrec, 1, 1, GEMV_TILE).float()
        sc = s[..., 2 * GEMV_TILE:].contiguous().view(torch.int8).view(t, nrec, gr, 1, GEMV_TILE).float()
        w = (d * sc) * (q - (32 if kind == "q6k" else 4))
    return w.permute(0, 4, 1, 2, 3).reshape(t * GEMV_TILE, -1)[:rows].contiguous()


def unpack_int8(tiles: list[torch.Tensor], rows: int, cols: int) -> torch.Tensor:
    """The float32 weight [rows, cols] of gemv_int8 tiles: q * scale (+ min), as gguf.quants dequantizes."""
    q, scales = tiles[0], tiles[1]
    t, kp, _ = q.shape
    ng = scales.shape[1]
    qr = q.transpose(1, 2).reshape(t * GEMV_TILE, ng, kp // ng)[:rows]
    w = torch.mul(qr, scales.transpose(1, 2).reshape(t * GEMV_TILE, ng, 1)[:rows])
    if len(tiles) > 2:
        w.add_(tiles[2].transpose(1, 2).reshape(t * GEMV_TILE, ng, 1)[:rows])
    return w.view(rows, kp)[:, :cols].contiguous()


def record_bytes(records: torch.Tensor | list[torch.Tensor]) -> int:
    """Bytes the GEMV streams for one layer's records."""
    parts = records if isinstance(records, list) else [records]
    return sum(p.numel() * p.element_size() for p in parts)
