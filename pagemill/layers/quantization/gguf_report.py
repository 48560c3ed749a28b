"""Which GGUF tensors run in which form: per (file format, kernel path), the tensor count and the bytes kept.

`weight_format_table(model)` reads the methods of a loaded model (GGUFQuantConfig tags each with the file formats
of its checkpoint tensors); `weight_format_lines` is the load log's (and `pagemill env`'s) text of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class FormatRow:
    """One (file format, kernel path) group of linear layers."""

    source: str  # the file's format(s) of the layer's tensors, e.g. q5_0 (mixed fused layers: q5_0+q8_0)
    path: str  # e.g. "int8 records", "q4k records", "float32 dense"
    tensors: int = 0
    nbytes: int = 0


def _dense_bytes(module: nn.Module) -> int:
    """Bytes of a dense layer's float weight (its oneDNN copy when the plain one was dropped)."""
    for name in ("weight", "mkldnn_weight"):
        w = getattr(module, name, None)
        if isinstance(w, torch.Tensor) and not w.is_mkldnn:
            return w.numel() * w.element_size()
    return 0


def weight_format_table(model: nn.Module) -> list[FormatRow]:
    """Rows for every GGUF-loaded linear layer of the model, largest first (empty for non-GGUF models)."""
    rows: dict[tuple[str, str], FormatRow] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        sources = getattr(method, "gguf_sources", None)
        if sources is None:
            continue
        records = getattr(method, "records", None)
        path = f"{records} records" if records else f"{method.weight_format} dense"
        source = "+".join(sorted(set(sources)))
        row = rows.setdefault((source, path), FormatRow(source, path))
        row.tensors += len(sources)
        row.nbytes += method.record_bytes if records else _dense_bytes(module)
    return sorted(rows.values(), key=lambda r: -r.nbytes)


def weight_format_lines(model: nn.Module) -> list[str]:
    """The table as text lines: `q5_0 -> int8 records: 72 tensors, 48.0 MB`."""
    return [f"{r.source} -> {r.path}: {r.tensors} tensors, {r.nbytes / 1e6:.1f} MB" for r in weight_format_table(model)]
