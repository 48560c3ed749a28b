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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.layers.quantization.base import LinearMethodBase, QuantConfig
from pagemill.layers.quantization.dense import DenseQuantConfig
from pagemill.layers.quantization.gguf_records import (BLOCK_LENGTHS, PLANE_LAYOUTS, RECORD_TYPES, kind_runs,
                                                       pack_int8, pack_planes, record_bytes, record_kind,
                                                       unpack_int8, unpack_planes)
from pagemill.layers.quantization.records_cache import RecordsCache
from pagemill.utils.memory import release_mapped_pages

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


@dataclass
class RecordsSegment:
    """Output rows [start, stop) of a layer held as records of one kind."""

    kind: str
    records: Any
    start: int
    stop: int


class RecordsLinearMethod(LinearMethodBase):
    """Weights held only as GEMV records (`records` names the kind: q4, q5, q4k, q5k, q6k, int8), for every number
    of rows. A layer is one or more row segments (`layer.gemv_segments`), each of one record kind: a fused layer
    whose parts mix kinds keeps each part's own records. Subclasses make the records at load."""

    def __init__(self, records: str, weight_format: str, dtype: torch.dtype, ops: TorchLayerOps) -> None:
        self.records, self.weight_format, self.input_dtype, self.ops = records, weight_format, dtype, ops
        self.record_bytes = 0  # of the layer's records, once packed (the weight-format report)
        # linear_dtype="int8": x quantized per row and block of 32 (Q4_K / Q6_K with VNNI: 256), integer products
        # (4-bit records, int8 tiles, 6-bit records with VNNI; the other kinds stay on the float kernels)
        self.int8_activations = False

    def set_records(self, layer: nn.Module, records: Any) -> None:
        """Install the layer's records, all of kind `self.records` (and its bias in float32, which the kernels add)."""
        self.set_segments(layer, [RecordsSegment(self.records, records, 0, layer.out_features)])

    def set_segments(self, layer: nn.Module, segments: list[RecordsSegment]) -> None:
        """Install the layer's row segments (in row order, covering every output row) and its float32 bias."""
        layer.gemv_segments = segments
        self.records = "+".join(dict.fromkeys(s.kind for s in segments))
        self.record_bytes = sum(record_bytes(s.records) for s in segments)
        layer.gemv_bias = None if layer.bias is None else layer.bias.float()
        layer.weight = None

    def records_only(self, layer: nn.Module) -> bool:
        """Whether apply is the records kernels on x as given (no step of its own before them): what a compiled
        caller (the CPU decoder graph) may run in its place."""
        return True

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The records kernels: streamed up to 16 rows, fp32 panels dequantized per k block beyond."""
        return self.matmul(layer, x.to(self.input_dtype), direct_only=False)

    def matmul(self, layer: nn.Module, x: torch.Tensor, direct_only: bool) -> torch.Tensor:
        """x [T, in] in input_dtype -> [T, out]; `direct_only` streams the records for every row count (each row
        summed in one fixed order: the batch-invariant path)."""
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty(x.shape[0], layer.out_features, dtype=self.input_dtype)
        segments, bias = layer.gemv_segments, layer.gemv_bias
        if len(segments) == 1:
            self._segment_matmul(segments[0], out, x, bias, direct_only)
        else:
            for seg in segments:
                seg_bias = None if bias is None else bias[seg.start:seg.stop]
                if x.shape[0] == 1:  # one row: the segment's columns of `out` are contiguous
                    self._segment_matmul(seg, out[:, seg.start:seg.stop], x, seg_bias, direct_only)
                else:
                    part = torch.empty(x.shape[0], seg.stop - seg.start, dtype=self.input_dtype)
                    self._segment_matmul(seg, part, x, seg_bias, direct_only)
                    out[:, seg.start:seg.stop] = part
        return out.view(*lead, layer.out_features)

    def _segment_matmul(self, seg: RecordsSegment, out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                        direct_only: bool) -> None:
        """out [T, rows of seg] = x @ W_seg^T (+ bias) on the segment's records kernel."""
        rec = seg.records
        if seg.kind == "int8":
            self.ops.gemv_int8(out, x, rec[0], rec[1], bias, rec[2] if len(rec) > 2 else None,
                                direct_only=direct_only, int8_activations=self.int8_activations)
        else:
            self.ops.gemv_records(out, x, rec, PLANE_LAYOUTS[seg.kind][3], bias,
                                  direct_only=direct_only, int8_activations=self.int8_activations)

    def release_resident_records(self, layer: nn.Module) -> None:
        """Take the layer's records out of the resident set when they are mapped from the records cache (the next
        use maps them again); nothing for records packed in memory."""
        if getattr(layer, "records_mapped", False):
            for seg in layer.gemv_segments:
                for part in seg.records if isinstance(seg.records, list) else [seg.records]:
                    release_mapped_pages(part)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight the records hold."""
        return torch.cat([_unpack_segment(s, layer.in_features) for s in layer.gemv_segments])


def _unpack_segment(seg: RecordsSegment, in_features: int) -> torch.Tensor:
    """The float32 rows a segment's records hold."""
    rows = seg.stop - seg.start
    if seg.kind in PLANE_LAYOUTS:
        return unpack_planes(seg.kind, seg.records, rows)
    return unpack_int8(seg.records, rows, in_features)


class GGUFLinearMethod(RecordsLinearMethod):
    """The layer's GGUF blocks as GEMV records (the parts of a fused layer may mix formats: see pack_records);
    weight_format names the file formats (q5_0, or q5_0+q8_0 for a mixed fused layer). The records hold exactly
    the file's dequantized values."""

    def __init__(self, formats: set[str], dtype: torch.dtype, ops: TorchLayerOps, cache: RecordsCache | None = None,
                 cache_key: str = "") -> None:
        super().__init__(record_kind(formats, ops.isa()), "+".join(sorted(formats)), dtype, ops)
        self.formats = formats
        self.cache, self.cache_key = cache, cache_key  # the file's records cache and this layer's key in it

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
