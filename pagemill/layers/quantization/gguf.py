"""GGUF Q4_1 / Q8_0 weights kept as stored: the file's blocks laid out for our GEMV kernels.

Up to `max_rows` rows (single streams, small batches) the weight-streaming kernels (csrc/variant/gemv.cpp) read
the Q4_1 / Q8_0 records (0.6-1.1 bytes per weight; the same weight values as the dequantized float32 model). More
rows use oneDNN on the dequantized weight, reordered once at load. Records are laid out from the file's blocks by
re-arranging bytes (`pack_q4_1_blocks`, `pack_q8_0_blocks`), no fitting: the bytes `pack_gemv_weight_q4` /
`pack_gemv_weight_int8` would produce from the dequantized weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.layers.quantization.base import LinearMethodBase, QuantConfig
from pagemill.layers.quantization.dense import F16_GEMV_MAX_ROWS, DenseQuantConfig, mkldnn_pack

GGUF_BLOCK = 32  # Q4_1 / Q8_0 block length along the input dimension
GEMV_TILE = 64  # output channels per packed GEMV tile (csrc/variant/gemv.cpp)
GGUF_FORMATS = {3: "q4_1", 8: "q8_0"}  # ggml type -> format kept as records
# float32 records: beyond 16 rows the kernels dequantize k blocks into L1 panels (an fp32 GEMM reading 0.6-1.1
# bytes per weight); measured per token (30 layers + head) on a Zen 5 at 32 / 64 rows: 31 / 55 ms vs oneDNN fp32
# 75 / 125 ms (AVX-512 variant), 69 / 120 ms (AVX2 variant). Larger prefill chunks stay on oneDNN.
RECORDS_MAX_ROWS = 64


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x with zero rows appended up to a whole number of GEMV tiles."""
    pad = (-x.shape[0]) % GEMV_TILE
    return x if pad == 0 else torch.cat((x, x.new_zeros((pad, *x.shape[1:]))))


def pack_q4_1_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """gemv_q4's packed records [T, K/32, 16 * 64 + 256] from GGUF Q4_1 blocks uint8 [N, K/32, 20].

    A block is fp16 d, fp16 m, then 16 bytes whose byte j holds q[j] (low nibble) and q[j + 16] (high); a record
    holds, per tile of 64 channels and group, 16 pair rows (byte c of row i = q[2i] | q[2i + 1] << 4 of channel c),
    then the 64 d, then the 64 m. Padding channels are zeros, as pack_gemv_weight_q4 leaves them.
    """
    b = _pad_rows(blocks)
    n, ng, _ = b.shape
    t = n // GEMV_TILE
    qs = b[..., 4:]
    q = torch.stack((qs & 15, qs >> 4), dim=2).view(n, ng, GGUF_BLOCK)  # q[0..31] in k order
    pairs = q[..., 0::2] | (q[..., 1::2] << 4)  # [N, ng, 16]
    pairs = pairs.view(t, GEMV_TILE, ng, GGUF_BLOCK // 2).permute(0, 2, 3, 1)  # [T, ng, 16, 64]
    dm = b[..., :4].reshape(t, GEMV_TILE, ng, 2, 2).permute(0, 2, 3, 1, 4)  # [T, ng, d|m, 64, 2 bytes]
    return torch.cat((pairs.reshape(t, ng, -1), dm.reshape(t, ng, -1)), dim=2)


def pack_q8_0_blocks(blocks: torch.Tensor) -> list[torch.Tensor]:
    """gemv_int8's [q int8 [T, K, 64], scales fp32 [T, K/32, 64]] from GGUF Q8_0 blocks uint8 [N, K/32, 34].

    pack_gemv_weight_int8(w, 32) takes scale = max|w| / 127 per group, which is the block's d: GGUF's quantizer
    puts +-127 in every non-zero block, and 127 * d (11 significant bits times 7) and its division by 127 are exact
    in fp32. Here the scale is d itself; tests/loader checks the two packings are byte-identical on SmolLM2.
    """
    b = _pad_rows(blocks)
    n, ng, _ = b.shape
    t = n // GEMV_TILE
    q = torch.empty(t, ng * GGUF_BLOCK, GEMV_TILE, dtype=torch.int8)
    q.view(t, ng, GGUF_BLOCK, GEMV_TILE).copy_(b[..., 2:].view(torch.int8).view(t, GEMV_TILE, ng, GGUF_BLOCK)
                                                .permute(0, 2, 3, 1))
    d = b[..., :2].contiguous().view(torch.float16).view(t, GEMV_TILE, ng).transpose(1, 2).float()
    return [q, d.contiguous()]


def unpack_q4_1_records(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """The float32 weight [rows, K] of gemv_q4 records: (d * q) + m, as gguf.quants dequantizes Q4_1."""
    t, ng, _ = packed.shape
    half = GGUF_BLOCK // 2
    pairs = packed[..., :half * GEMV_TILE].view(t, ng, half, GEMV_TILE)
    q = torch.stack((pairs & 15, pairs >> 4), dim=3).view(t, ng, GGUF_BLOCK, GEMV_TILE)  # k = 2i, 2i + 1
    q = q.permute(0, 3, 1, 2).reshape(t * GEMV_TILE, ng, GGUF_BLOCK)[:rows]
    dm = packed[..., half * GEMV_TILE:].contiguous().view(torch.float16).view(t, ng, 2, GEMV_TILE)
    dm = dm.permute(0, 3, 1, 2).reshape(t * GEMV_TILE, ng, 2)[:rows].float()
    w = torch.mul(q, dm[..., 0:1])
    return w.add_(dm[..., 1:2]).view(rows, ng * GGUF_BLOCK)


def unpack_q8_0_tiles(q: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The float32 weight [rows, cols] of gemv_int8 tiles: q * scale, as gguf.quants dequantizes Q8_0."""
    t, kp, _ = q.shape
    qr = q.transpose(1, 2).reshape(t * GEMV_TILE, kp // GGUF_BLOCK, GGUF_BLOCK)[:rows]
    sr = scales.transpose(1, 2).reshape(t * GEMV_TILE, -1, 1)[:rows]
    return torch.mul(qr, sr).view(rows, kp)[:, :cols].contiguous()


class GGUFLinearMethod(LinearMethodBase):
    """The layer's Q4_1 or Q8_0 blocks (every part of a fused layer in one format) as GEMV records, plus a oneDNN
    copy of the dequantized weight for more rows than the GEMV serves."""

    def __init__(self, weight_format: str, dtype: torch.dtype, kernels: Any) -> None:
        self.weight_format, self.input_dtype, self.kernels = weight_format, dtype, kernels
        self.max_rows = RECORDS_MAX_ROWS if dtype == torch.float32 else F16_GEMV_MAX_ROWS

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        """Room for the checkpoint parts (loaded lazily from the file; nothing is allocated)."""
        layer.gguf_parts = {}
        layer.in_features, layer.out_features = in_features, out_features

    def load_weight(self, layer: nn.Module, loaded: Any, row_offset: int, shard_index: int) -> None:
        """Keep the part's blocks (views of the file map) for process_weights_after_loading."""
        if getattr(loaded, "format", None) != self.weight_format:
            raise ValueError(f"expected a {self.weight_format} GGUF tensor, got {type(loaded).__name__} "
                             f"{getattr(loaded, 'format', '')}")
        layer.gguf_parts[row_offset] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Records from the blocks, the oneDNN copy from their dequantized values; the file pages are released."""
        parts = sorted(layer.gguf_parts.items())  # (row offset, GGUF weight)
        blocks = parts[0][1].blocks if len(parts) == 1 else torch.cat([p.blocks for _, p in parts])
        if blocks.shape[0] != layer.out_features:
            raise ValueError(f"GGUF blocks cover {blocks.shape[0]} of {layer.out_features} rows")
        if self.weight_format == "q4_1":
            layer.gemv_q4, layer.gemv_q8 = pack_q4_1_blocks(blocks), None
        else:
            layer.gemv_q4, layer.gemv_q8 = None, pack_q8_0_blocks(blocks)
        del blocks
        layer.gemv_bias = None if layer.bias is None else layer.bias.float()
        # A layer may already hold the same values as floats (a tied LM head: the embedding's table); else decode.
        weight = getattr(layer, "float_weight", None)
        if weight is None:
            weight = torch.empty(layer.out_features, layer.in_features, dtype=torch.float32)
            for offset, part in parts:
                part.load_into(weight.narrow(0, offset, part.shape[0]))  # gguf.quants' arithmetic, bit for bit
        weight = weight.to(self.input_dtype)
        layer.mkldnn_weight = mkldnn_pack(weight)
        # With the oneDNN copy nothing reads a plain weight (a third copy, 4 bytes per weight): it is kept only where
        # oneDNN is unavailable.
        layer.weight = None if layer.mkldnn_weight is not None else weight
        for _, part in parts:
            part.release()
        layer.gguf_parts = {}

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The records GEMV up to max_rows rows, else oneDNN."""
        x = x.to(self.input_dtype)
        if x.dim() == 2 and x.shape[0] <= self.max_rows:
            out = torch.empty(x.shape[0], layer.out_features, dtype=self.input_dtype)
            if layer.gemv_q4 is not None:
                self.kernels.gemv_q4(out, x.contiguous(), layer.gemv_q4, layer.gemv_bias)
            else:
                self.kernels.gemv_int8(out, x.contiguous(), *layer.gemv_q8, layer.gemv_bias)
            return out
        if layer.mkldnn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, layer.mkldnn_weight, layer.bias, "none", [], "")
        return F.linear(x, layer.weight, layer.bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight the records hold (bit-identical to the file's dequantized values)."""
        if layer.gemv_q4 is not None:
            return unpack_q4_1_records(layer.gemv_q4, layer.out_features)
        return unpack_q8_0_tiles(*layer.gemv_q8, layer.out_features, layer.in_features)


class GGUFQuantConfig(QuantConfig):
    """A GGUF file's layers: GGUFLinearMethod where every part of a layer is Q4_1 (or every part Q8_0) and the
    kernels engine runs in float32 / float16; the dense methods (on the dequantized weights) elsewhere."""

    def __init__(self, tensor_types: dict[str, int], dense: DenseQuantConfig) -> None:
        self.tensor_types, self.dense = tensor_types, dense  # HF name -> ggml type

    def get_linear_method(self, checkpoint_names: list[str], in_features: int) -> LinearMethodBase:
        """Records for a layer whose parts share one block format, else the dense method."""
        dtype, kernels = self.dense.linear_dtype, self.dense.kernels
        formats = {GGUF_FORMATS.get(self.tensor_types.get(n, -1)) for n in checkpoint_names}
        if (kernels is not None and dtype in (torch.float32, torch.float16) and len(formats) == 1
                and None not in formats and in_features % GGUF_BLOCK == 0):
            return GGUFLinearMethod(formats.pop(), dtype, kernels)
        return self.dense.get_linear_method(checkpoint_names, in_features)
