"""GGUF test blocks of every kept format and their gguf.quants dequantization (shared by kernel and layer tests)."""

from __future__ import annotations

import numpy as np
import torch

QUANTIZABLE = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0"}  # gguf.quants.quantize supports these
# d / dmin byte offsets of the K-quant and IQ4 blocks (set to sane fp16 values in random blocks)
_K_HALVES = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_nl": (0,),
             "iq4_xs": (0,)}


def _qtype(fmt: str):
    import gguf

    return getattr(gguf.GGMLQuantizationType, fmt.upper())


def make_blocks(fmt: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Blocks uint8 [n, k / block, bytes]: gguf's quantizer on random weights where it has one, else random bytes
    with random positive fp16 d / dmin."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quantize

    length, nbytes = GGML_QUANT_SIZES[_qtype(fmt)]
    rng = np.random.default_rng(seed)
    if fmt in QUANTIZABLE:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), _qtype(fmt))
    else:
        raw = rng.integers(0, 256, (n, k // length, nbytes), dtype=np.uint8)
        for o in _K_HALVES[fmt]:
            d = (rng.random((n, k // length)) * 0.01 + 1e-3).astype(np.float16)
            raw[..., o:o + 2] = d[..., None].view(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(raw)).view(n, k // length, nbytes)


def dequantized(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    """gguf.quants' float32 weight of the blocks."""
    from gguf.quants import dequantize

    n = blocks.shape[0]
    return torch.from_numpy(np.asarray(dequantize(blocks.reshape(n, -1).numpy(), _qtype(fmt)), np.float32))
