"""GGUF weights kept as stored: the file's blocks laid out for our GEMV kernels (Q4_0 .. Q8_0, Q2_K .. Q6_K,
IQ4_NL, IQ4_XS).

Every matmul reads records laid out from the file's blocks by re-arranging bits, no fitting (`gguf_records`):
bit-plane records (4-bit codes for Q4_0 / Q4_1 / Q4_K and, in 4-bit records, Q2_K / Q3_K; 5-bit for Q5_0 / Q5_1 /
Q5_K; 6-bit for Q6_K) with the file's scales, int8 tiles for Q8_0 and for fused layers whose parts mix record kinds.
They hold exactly the file's dequantized float32 weights, and they are the only copy of them: up to 16 rows the
kernels (csrc/cpu/variant/gemv.cpp) stream the records inside the dot products, more rows (batched decode, prefill)
dequantize k blocks of a tile into cache-resident fp32 panels, as fast as oneDNN's fp32 GEMM on a float copy from
17 to 512 rows (benchmarks/README.md) at a quarter or less of the memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagemill.layers.quantization.base import LinearMethodBase, QuantConfig
from pagemill.layers.quantization.dense import DenseQuantConfig
from pagemill.layers.quantization.gguf_records import (BLOCK_LENGTHS, PLANE_LAYOUTS, RECORD_TYPES, kind_runs,
                                                       pack_int8, pack_planes, record_kind)
from pagemill.layers.quantization.records import RecordsLinearMethod, RecordsSegment
from pagemill.layers.quantization.records_cache import RecordsCache

if TYPE_CHECKING:
    from pagemill.kernels.ops import TorchLayerOps

GGUF_FORMATS = {t: name for t, (name, _, _) in RECORD_TYPES.items()}  # ggml type -> format kept as records


def pack_q4_1_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """gemv_q4's packed records [T, K/32, 16 * 64 + 256] from GGUF Q4_1 blocks uint8 [N, K/32, 20]: the bytes
    pack_gemv_weight_q4 makes from the dequantized weight."""
    return pack_planes("q4", [("q4_1", blocks)])


def pack_q8_0_blocks(blocks: torch.Tensor) -> list[torch.Tensor]:
    """gemv_int8's [q int8 [T, K, 64], scales fp32 [T, K/32, 64]] from GGUF Q8_0 blocks uint8 [N, K/32, 34].

    pack_gemv_weight_int8(w, 32) takes scale = max|w| / 127 per group, which is the block's d: GGUF's quantizer
    puts +-127 in every non-zero block, and 127 * d (11 significant bits times 7) and its division by 127 are exact
    in fp32. Here the scale is d itself; tests/loader checks the two packings are byte-identical on SmolLM2.
    """
    return pack_int8([("q8_0", blocks)])


def pack_records(parts: list[tuple[str, torch.Tensor]], isa: str | None = None) -> tuple[str, Any]:
    """(record kind, records) of a layer's parts (format, blocks [N_i, nb, bytes]), rows in order: bit-plane
    records when the parts share a bit-plane kind that kernel variant `isa` unpacks fast, else "int8" tiles (also
    for a Q4_0 / Q5_0 whose m overflows)."""
    kind = record_kind({fmt for fmt, _ in parts}, isa)
    if kind in PLANE_LAYOUTS:
        records = pack_planes(kind, parts)
        if records is not None:
            return kind, records
        kind = "int8"
    return kind, pack_int8(parts)


class GGUFLinearMethod(RecordsLinearMethod):
    """The layer's GGUF blocks as GEMV records (the parts of a fused layer may mix formats: see pack_records);
    weight_format names the file formats (q5_0, or q5_0+q8_0 for a mixed fused layer). The records hold exactly
    the file's dequantized values."""

    def __init__(self, formats: set[str], dtype: torch.dtype, ops: TorchLayerOps, cache: RecordsCache | None = None,
                 cache_key: str = "") -> None:
        super().__init__(record_kind(formats, ops.isa()), "+".join(sorted(formats)), dtype, ops)
        self.formats = formats
        self.use_cache(cache, cache_key)  # the file's records cache and this layer's key in it

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        """Room for the checkpoint parts (loaded lazily from the file; nothing is allocated)."""
        layer.gguf_parts = {}
        layer.in_features, layer.out_features = in_features, out_features

    def load_weight(self, layer: nn.Module, loaded: Any, row_offset: int, shard_index: int) -> None:
        """Keep the part's blocks (views of the file map) for process_weights_after_loading."""
        if getattr(loaded, "format", None) not in self.formats:
            raise ValueError(f"expected a {self.weight_format} GGUF tensor, got {type(loaded).__name__} "
                             f"{getattr(loaded, 'format', '')}")
        layer.gguf_parts[row_offset] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Records from the cache, else from the blocks (nothing is decoded to floats); the file pages are
        released."""
        parts = sorted(layer.gguf_parts.items())  # (row offset, GGUF weight)
        rows = sum(p.shape[0] for _, p in parts)
        if rows != layer.out_features:
            raise ValueError(f"GGUF blocks cover {rows} of {layer.out_features} rows")
        segments, start, mapped = [], 0, True
        runs = kind_runs([(p.format, p.blocks) for _, p in parts], self.ops.isa())
        for run in runs:
            stop = start + sum(b.shape[0] for _, b in run)
            key = self.cache_key if len(runs) == 1 else f"{self.cache_key}@{start}"
            cached = self.cache.lookup(key) if self.cache is not None else None
            mapped = mapped and cached is not None
            if cached is not None:
                kind, records = cached
            else:
                kind, records = pack_records(run, self.ops.isa())
                if self.cache is not None:
                    self.cache.add(key, kind, records)
            segments.append(RecordsSegment(kind, records, start, stop))
            start = stop
        layer.records_mapped = mapped  # read-only views of the cache file's map
        self.set_segments(layer, segments)
        # One tensor's blocks in the file's row order (an LM head's): the rows the greedy head screen rechecks.
        layer.gguf_rows = (parts[0][1].blocks, parts[0][1].tensor.ggml_type) if len(parts) == 1 else None
        for _, part in parts:
            part.release()
        layer.gguf_parts = {}


class GGUFQuantConfig(QuantConfig):
    """A GGUF file's layers: GGUFLinearMethod where every part of a layer is in a record format (Q4_0 .. Q8_0,
    Q2_K .. Q6_K, IQ4_NL, IQ4_XS) and the kernels engine runs in float32 / float16; the dense methods (on the
    dequantized weights) elsewhere."""

    def __init__(self, tensor_types: dict[str, int], dense: DenseQuantConfig,
                 records_cache: RecordsCache | None = None) -> None:
        self.tensor_types, self.dense = tensor_types, dense  # HF name -> ggml type
        self.records_cache = records_cache  # laid-out records of earlier starts (records_cache.py)

    def get_linear_method(self, checkpoint_names: list[str], in_features: int) -> LinearMethodBase:
        """Records for a layer whose parts are all in record formats, else the dense method; either is tagged with
        the file formats of its tensors (`gguf_sources`, for the weight-format report)."""
        method = self._choose(checkpoint_names, in_features)
        method.gguf_sources = [_type_name(self.tensor_types.get(n)) for n in checkpoint_names]
        return method

    def _choose(self, checkpoint_names: list[str], in_features: int) -> LinearMethodBase:
        dtype, ops = self.dense.linear_dtype, self.dense.ops
        formats = {GGUF_FORMATS.get(self.tensor_types.get(n, -1)) for n in checkpoint_names}
        if (ops.linear_kernels and dtype in (torch.float32, torch.float16) and None not in formats
                and all(in_features % BLOCK_LENGTHS[f] == 0 for f in formats)):
            method = GGUFLinearMethod(formats, dtype, ops, self.records_cache, "+".join(checkpoint_names))
            method.int8_activations = self.dense.int8_activations
            return method
        return self.dense.get_linear_method(checkpoint_names, in_features)


def _type_name(ggml_type: int | None) -> str:
    """q5_0, f16, ... for a ggml type id ("missing" for a name the file lacks)."""
    if ggml_type is None:
        return "missing"
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name.lower()
    except ValueError:
        return f"type{ggml_type}"
