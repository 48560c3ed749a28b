"""What a loaded model's weights cost, by how they are held, and the process's resident memory: the load log's
memory line (a quantized model should cost about its file)."""

from __future__ import annotations

import torch
from torch import nn

from pagemill.utils.memory import resident_bytes


def weight_bytes_by_kind(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights: "records" (quantized linears' GEMV records, packed or mapped from the records
    cache), "file blocks" (GGUF blocks read in place, e.g. a quantized embedding), "float" (every float parameter,
    buffer or prepacked copy; a tied table once)."""
    kinds = {"records": 0, "file blocks": 0, "float": 0}
    seen: set[int] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kinds["records"] += getattr(method, "record_bytes", 0) if getattr(method, "records", None) else 0
        blocks = getattr(module, "blocks", None)
        if isinstance(blocks, torch.Tensor):
            kinds["file blocks"] += blocks.numel() * blocks.element_size()
        held = [*module._parameters.values(), *module._buffers.values(), getattr(module, "mkldnn_weight", None)]
        for t in held:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and id(t) not in seen:
                seen.add(id(t))
                kinds["float"] += t.numel() * t.element_size()
    return kinds


def weight_memory_line(model: nn.Module) -> str:
    """`weights: records 0.80 GB, file blocks 0.26 GB, float 0.01 GB; resident 1.21 GB` (zero kinds left out)."""
    kinds = weight_bytes_by_kind(model)
    held = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in kinds.items() if v) or "none"
    return f"weights: {held}; resident {resident_bytes() / 1e9:.2f} GB"
