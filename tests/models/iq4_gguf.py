"""A copy of a GGUF whose 2-D weights are requantized to IQ4_XS (rows of a multiple of 256) or IQ4_NL (the others),
as llama.cpp's IQ4_XS files mix them. gguf-py dequantizes IQ4 but cannot quantize it, so this module does, simply:
each block's largest magnitude maps to the table's -127 and every weight takes its nearest table value."""

from __future__ import annotations

import numpy as np

from pagemill.layers.quantization import gguf_records
from tests.models.gguf_rewrite import rewrite_weights

IQ4_VALUES = np.array(gguf_records.IQ4_VALUES, dtype=np.float32)


def _nearest(w: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Indices [..., 32] of the table values nearest w / d (d [..., 1]; d == 0 takes index 8, the value 1)."""
    safe = np.where(d == 0, 1.0, d)
    idx = np.searchsorted((IQ4_VALUES[1:] + IQ4_VALUES[:-1]) / 2, w / safe).astype(np.uint8)
    return np.where(d == 0, np.uint8(8), idx)


def _pack_nibbles(idx: np.ndarray) -> np.ndarray:
    """[..., 32] indices -> [..., 16] bytes: element j in the low nibble of byte j, j + 16 in the high one."""
    return (idx[..., :16] | (idx[..., 16:] << 4)).astype(np.uint8)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> IQ4_NL blocks uint8 [n, k / 32 * 18] (fp16 d, 16 bytes of indices per 32)."""
    n, k = w.shape
    b = w.reshape(n, k // 32, 32)
    big = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    d = (big / IQ4_VALUES[0]).astype(np.float16)
    idx = _nearest(b, d.astype(np.float32))
    return np.concatenate((d.view(np.uint8), _pack_nibbles(idx)), axis=-1).reshape(n, -1)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> IQ4_XS blocks uint8 [n, k / 256 * 136]: fp16 D, then per 32 a 6-bit ls (d = D (ls - 32),
    low 4 bits in scales_l, high 2 in scales_h) and 16 bytes of indices."""
    n, k = w.shape
    b = w.reshape(n, k // 256, 8, 32)
    big = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)[..., 0]
    s = big / IQ4_VALUES[0]  # each 32's ideal scale (signed)
    dd = (np.abs(s).max(-1, keepdims=True) / 31).astype(np.float16)
    d32 = dd.astype(np.float32)
    ls = (np.clip(np.rint(s / np.where(d32 == 0, 1.0, d32)), -32, 31) + 32).astype(np.uint16)
    idx = _nearest(b, (d32 * (ls.astype(np.float32) - 32))[..., None])
    scales_h = np.zeros(ls.shape[:-1], dtype=np.uint16)
    for j in range(8):
        scales_h |= (ls[..., j] >> 4) << (2 * j)
    low = (ls & 15).astype(np.uint8)
    scales_l = low[..., 0::2] | (low[..., 1::2] << 4)
    out = np.concatenate((dd.view(np.uint8), scales_h[..., None].view(np.uint8), scales_l,
                          _pack_nibbles(idx).reshape(n, k // 256, 128)), axis=-1)
    return out.reshape(n, -1)


def requantize_to_iq4(src: str, dst: str) -> None:
    """Write `dst`: `src`'s metadata and tensors, its 2-D weights as IQ4_XS / IQ4_NL (values dequantized by
    gguf.quants first)."""
    import gguf

    def encode(w: np.ndarray) -> tuple[np.ndarray, int] | None:
        if w.shape[1] % 32:
            return None
        if w.shape[1] % 256 == 0:
            return quantize_iq4_xs(w), gguf.GGMLQuantizationType.IQ4_XS
        return quantize_iq4_nl(w), gguf.GGMLQuantizationType.IQ4_NL

    rewrite_weights(src, dst, encode)
