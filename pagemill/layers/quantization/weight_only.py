"""Weight-only int8 / int4 quantization of a float (safetensors) checkpoint at load, run by the GGUF records' kernels.

- int8: asymmetric, per group of 16 inputs (w = d * q + m, q in [-128, 127], fp32 d and m; 1.5 bytes per weight):
  gemv_int8's tiles with mins (`int8_grid.quantize_int8`). Each group's d and m are the least-squares fit of the
  best of a few candidate grids around d = (max - min) / 255 (llama.cpp's make_qkx2_quants search), and of the
  enclosing group of 32's plain grid, so a checkpoint already on a coarser grid (a Q4_1 GGUF's values) comes
  back exactly. Against the former symmetric fit per 32 (Q8_0's layout, max|w| / 127, 1.125 bytes) the relative
  weight error falls from 0.55% to 0.35% on SmolLM2 and |delta logprob| by 30-40%; the offset uses all 256 codes on
  a group's range, the group of 16 halves the span an outlier coarsens (benchmarks/README.md, issue 14).
- int4: asymmetric, per group of 32 (w = d * q + m, q in 0..15, fp16 d = (max - min) / 15, fp16 m = min): the
  Q4_1 records `pack_gemv_weight_q4` fits for `gemv_q4` (0.625 bytes per weight).

Every row count runs on the records alone (RecordsLinearMethod.apply: streamed up to 16 rows, fp32 panels
dequantized per k block beyond); no float copy of a quantized weight is kept, and the records cache keeps the
records for the next start (which then quantizes nothing). The LM head (tied or not) and the embedding stay float:
the head's error lands directly on the logits, and a tied head shares the embedding's table at no extra memory.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagemill.layers.quantization.base import LinearMethodBase, QuantConfig, copy_into
from pagemill.layers.quantization.dense import DenseQuantConfig
from pagemill.layers.quantization.records import RecordsLinearMethod
from pagemill.layers.quantization.gguf_records import GEMV_TILE
from pagemill.layers.quantization.int8_grid import int8_tiles, quantize_int8
from pagemill.utils.memory import file_mapped, release_free_memory, release_mapped_pages

if TYPE_CHECKING:
    from pagemill.kernels.ops import TorchLayerOps

WEIGHT_ONLY_FORMATS = ("int8", "int4")
INT8_GROUP = 16  # inputs per int8 scale and min (gemv_int8 takes 16 or 32)
QUANT_GROUP = 32  # inputs per int4 scale and min: the Q4_1 block of gemv_q4's records
FORMAT_GROUPS = {"int8": INT8_GROUP, "int4": QUANT_GROUP}
FLOAT_LAYER_SUFFIXES = ("lm_head.weight", "embed_tokens.weight")  # the LM head's checkpoint names (tied or not)


class WeightOnlyLinearMethod(RecordsLinearMethod):
    """A float checkpoint weight quantized at load into int8 tiles or int4 (Q4_1) records, its only copy;
    apply / dequantized_weight are the GGUF records' (same kernels, same layouts)."""

    def __init__(self, weight_format: str, dtype: torch.dtype, ops: TorchLayerOps) -> None:
        if weight_format not in WEIGHT_ONLY_FORMATS:
            raise ValueError(f"quantization must be one of {', '.join(WEIGHT_ONLY_FORMATS)}, got {weight_format!r}.")
        super().__init__("int8" if weight_format == "int8" else "q4", weight_format, dtype, ops)

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        """The records an earlier start made (mapped from the records cache), else room for the parts: each part of
        whole 64-row tiles (every real model's) is quantized as it arrives; other layers fill a float32 staging
        weight [out, in] (freed once quantized)."""
        layer.in_features, layer.out_features = in_features, out_features
        layer.cached_records = self.cached_records()
        layer.part_records = {}  # row offset -> (rows, the part's records)
        sizes = getattr(layer, "output_sizes", [out_features])
        whole_tiles = all(size % GEMV_TILE == 0 for size in sizes)
        layer.weight = None if layer.cached_records is not None or whole_tiles else torch.empty(
            out_features, in_features, dtype=torch.float32)

    def load_weight(self, layer: nn.Module, loaded: Any, row_offset: int, shard_index: int) -> None:
        """Quantize the part (whole tiles), or copy it (converting to float32) into rows [row_offset, + rows) of
        the staging weight; nothing when the records are cached."""
        if not isinstance(loaded, torch.Tensor) or not loaded.is_floating_point():
            raise ValueError(f"quantization={self.weight_format!r} quantizes float checkpoint tensors, got "
                             f"{type(loaded).__name__} {getattr(loaded, 'dtype', getattr(loaded, 'format', ''))}")
        if loaded.dim() != 2 or loaded.shape[1] != layer.in_features:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected [rows, "
                             f"{layer.in_features}]")
        if layer.cached_records is not None:
            return
        if layer.weight is not None:
            copy_into(layer.weight.narrow(0, row_offset, loaded.shape[0]), loaded)
        elif row_offset % GEMV_TILE or loaded.shape[0] % GEMV_TILE:
            raise ValueError(f"rows [{row_offset}, {row_offset + loaded.shape[0]}) are not whole 64-row tiles")
        else:
            layer.part_records[row_offset] = (loaded.shape[0], self._quantize(loaded.float()))
            if file_mapped(loaded):  # read once: the file's pages leave the resident set
                release_mapped_pages(loaded)
            release_free_memory()  # the fit's temporaries (freed heap pages otherwise stay mapped: utils.memory)

    def _quantize(self, w: torch.Tensor) -> Any:
        """The records of float32 rows w [rows, in]: int8 tiles [q, scales, mins] or Q4_1 records."""
        if not torch.isfinite(w).all():
            raise ValueError(f"quantization={self.weight_format!r}: the checkpoint weight has non-finite values")
        if self.weight_format == "int8":
            return int8_tiles(quantize_int8(w, INT8_GROUP, asymmetric=True, search=True))
        records, err = self.ops.pack_gemv_weight_q4(w, QUANT_GROUP)
        if not math.isfinite(float(err)):  # d or m past float16's range
            raise ValueError("quantization='int4' needs weights within float16 range (|w| <= 32768)")
        return records

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Install the cached records, or the parts' records stacked in row order, or quantize the staging weight
        (then freed)."""
        cached, layer.cached_records = layer.cached_records, None
        parts, layer.part_records = sorted(layer.part_records.items()), {}
        if cached is not None:
            self.install_records(layer, cached, mapped=True)
            return
        if layer.weight is not None:
            records = self._quantize(layer.weight)
            layer.weight = None
        else:
            rows = sum(n for _, (n, _) in parts)
            if rows != layer.out_features:
                raise ValueError(f"checkpoint parts cover {rows} of {layer.out_features} rows")
            records = [r for _, (_, r) in parts]
            if self.weight_format == "int8":  # [q, scales, mins], each stacked over the parts' tiles
                records = [torch.cat(kind) if len(parts) > 1 else kind[0] for kind in zip(*records)]
            else:
                records = torch.cat(records) if len(parts) > 1 else records[0]
        self.install_records(layer, records, mapped=False)


class WeightOnlyQuantConfig(QuantConfig):
    """int8 / int4 weight-only quantization of every linear layer but the LM head; the dense method elsewhere."""

    def __init__(self, weight_format: str, dense: DenseQuantConfig) -> None:
        if weight_format not in WEIGHT_ONLY_FORMATS:
            raise ValueError(f"quantization must be one of {', '.join(WEIGHT_ONLY_FORMATS)}, got {weight_format!r}.")
        if not dense.ops.linear_kernels:
            raise ValueError(f"quantization={weight_format!r} runs pagemill's compiled GEMV kernels, which this "
                             "engine does not use (attention_backend='torch', or the kernels are not built).")
        if dense.linear_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"quantization={weight_format!r} needs float32 or float16 matmuls (the GEMV kernels' "
                             f"inputs); linear_dtype resolves to {str(dense.linear_dtype).removeprefix('torch.')} (set "
                             "linear_dtype='float32' or 'float16').")
        self.weight_format, self.dense = weight_format, dense

    def get_linear_method(self, checkpoint_names: list[str], in_features: int) -> LinearMethodBase:
        """The quantized method, except for the LM head and inputs not a whole number of groups (dense)."""
        head = any(n.endswith(FLOAT_LAYER_SUFFIXES) for n in checkpoint_names)
        if head or in_features % FORMAT_GROUPS[self.weight_format]:
            return self.dense.get_linear_method(checkpoint_names, in_features)
        method = WeightOnlyLinearMethod(self.weight_format, self.dense.linear_dtype, self.dense.ops)
        method.use_cache(self.dense.records_cache, "+".join(checkpoint_names))
        method.int8_activations = self.dense.int8_activations
        return method
