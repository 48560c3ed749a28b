"""A quantized safetensors checkpoint (GPTQ, AWQ, compressed-tensors, FP8) read as one weight per linear.

The tensors a quantized linear stores (qweight / qzeros / scales / g_idx, weight_packed / weight_scale / ..., an fp8
weight and its scales) are gathered per module, decoded (checkpoint_formats.decode_linear) and yielded under the
module's `weight` name as QuantCodes (integer formats) or a float32 tensor (fp8); every other tensor passes through.
A module's tensors are held only until its last one has been read.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagemill.layers.quantization.checkpoint_formats import (CheckpointQuant, LazyQuantWeight, decode_linear,
                                                             parse_checkpoint_quant, quantized_prefixes)
from pagemill.layers.quantization.records_cache import RecordsCache


# attention scales some FP8 checkpoints carry for an fp8 KV cache: not read (the KV cache here is float)
KV_CACHE_SCALES = frozenset({"k_scale", "v_scale", "q_scale", "kv_scale", "prob_scale"})


def checkpoint_tensor_names(model_dir: str) -> list[str]:
    """Every tensor name in the directory's safetensors files (headers only)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"a quantized checkpoint needs *.safetensors weight files; {model_dir!r} has none.")
    names = []
    for f in files:
        with safe_open(f, framework="pt") as st:
            names.extend(st.keys())
    return names


class QuantizedCheckpoint:
    """The checkpoint's quantization (checked) and which of its modules are quantized linears."""

    def __init__(self, model_dir: str, quantization_config: Any) -> None:
        self.spec: CheckpointQuant = parse_checkpoint_quant(quantization_config)
        self.files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        self.prefixes = quantized_prefixes(self.spec, checkpoint_tensor_names(model_dir))

    def records_cache(self, layout: str) -> RecordsCache | None:
        """The records cache of these weight files for this rank and kernel layout; None when caching is off or
        the weights run on the float path (fp8)."""
        if not self.spec.integer or not self.files:
            return None
        return RecordsCache.for_weight_files(self.files, layout)

    @property
    def quantized_weights(self) -> set[str]:
        """The `weight` names of the linears stored as integer codes (fp8 weights load as float tensors)."""
        return {f"{p}.weight" for p in self.prefixes} if self.spec.integer else set()

    def weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
        """(name, tensor) with each quantized linear's tensors replaced by one decoded `prefix.weight`."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            prefix, _, suffix = name.rpartition(".")
            if suffix in KV_CACHE_SCALES:
                continue
            want = self.prefixes.get(prefix)
            if want is None or suffix not in want:
                yield name, tensor
                continue
            parts = pending.setdefault(prefix, {})
            parts[suffix] = tensor
            if set(parts) == want:
                del pending[prefix]
                if self.spec.integer:  # decoded by the layer, unless its records are cached
                    yield f"{prefix}.weight", LazyQuantWeight(self.spec, prefix, parts)
                else:
                    yield f"{prefix}.weight", decode_linear(self.spec, prefix, parts)
        if pending:
            prefix, parts = next(iter(pending.items()))
            raise ValueError(f"quantized tensors of {prefix!r} are incomplete: {sorted(parts)} of "
                             f"{sorted(self.prefixes[prefix])}")
