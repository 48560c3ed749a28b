"""Linear layers held only as GEMV records: the weights laid out for csrc/cpu/variant/gemv.cpp's kernels, in row
segments of one record kind each, run at every row count (streamed up to 16 rows, fp32 panels beyond).

The kinds: GGUF bit-plane records (q4, q5, q4k, q5k, q6k, q2k, q3k: gguf_records.PLANE_LAYOUTS), int8 tiles
(Q8_0, IQ4, mixed fused layers, on-load int8), and 16-bit tiles (f16 / bf16: half_tiles.py). GGUF files, weight-only
quantization, prequantized checkpoints and 16-bit checkpoints make them; this module runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagemill.layers.quantization.base import LinearMethodBase
from pagemill.layers.quantization.gguf_records import PLANE_LAYOUTS, record_bytes, unpack_int8, unpack_planes
from pagemill.utils.memory import release_mapped_pages

if TYPE_CHECKING:
    from pagemill.kernels.ops import TorchLayerOps
    from pagemill.layers.quantization.records_cache import RecordsCache

HALF_TILE_KINDS = {"f16": torch.float16, "bf16": torch.bfloat16}  # 16-bit tiles [tiles, K, 64] of that dtype


@dataclass
class RecordsSegment:
    """Output rows [start, stop) of a layer held as records of one kind."""

    kind: str
    records: Any
    start: int
    stop: int


class RecordsLinearMethod(LinearMethodBase):
    """Weights held only as GEMV records (`records` names the kind: q4, q5, q4k, q5k, q6k, q2k, q3k, int8, f16,
    bf16), for every number of rows. A layer is one or more row segments (`layer.gemv_segments`), each of one
    record kind: a fused layer whose parts mix kinds keeps each part's own records. Subclasses make the records at
    load."""

    def __init__(self, records: str, weight_format: str, dtype: torch.dtype, ops: TorchLayerOps) -> None:
        self.records, self.weight_format, self.input_dtype, self.ops = records, weight_format, dtype, ops
        self.record_bytes = 0  # of the layer's records, once packed (the weight-format report)
        # linear_dtype="int8": x quantized per row and block of 32 (Q4_K / Q6_K with VNNI: 256), integer products
        # (4-bit records, int8 tiles, 6-bit records with VNNI; the other kinds stay on the float kernels)
        self.int8_activations = False
        self.cache: RecordsCache | None = None  # the weight file's records cache (records_cache.py), if any
        self.cache_key = ""  # this layer's key in it

    def use_cache(self, cache: RecordsCache | None, key: str) -> RecordsLinearMethod:
        """Look the layer's records up in `cache` under `key`, and remember them there once packed."""
        self.cache, self.cache_key = cache, key
        return self

    def cached_records(self) -> Any:
        """The records an earlier start packed for this layer, mapped read-only from the cache; None if none."""
        hit = self.cache.lookup(self.cache_key) if self.cache is not None else None
        return hit[1] if hit is not None and hit[0] == self.records else None

    def install_records(self, layer: nn.Module, records: Any, mapped: bool) -> None:
        """Install the layer's one segment: records mapped from the cache, or packed this start (remembered for
        the cache)."""
        if not mapped and self.cache is not None:
            self.cache.add(self.cache_key, self.records, records)
        layer.records_mapped = mapped
        self.set_records(layer, records)

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
        if seg.kind in HALF_TILE_KINDS:  # (float products: int8 activations apply to quantized weights only)
            gemv = self.ops.gemv_f16 if seg.kind == "f16" else self.ops.gemv_bf16
            gemv(out, x, rec, bias, direct_only=direct_only)
        elif seg.kind == "int8":
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
    if seg.kind in HALF_TILE_KINDS:
        return seg.records.transpose(1, 2).reshape(-1, in_features)[:rows].float()
    if seg.kind in PLANE_LAYOUTS:
        return unpack_planes(seg.kind, seg.records, rows)
    return unpack_int8(seg.records, rows, in_features)
