"""The linear-method contract: how a linear layer's weights are stored, loaded, prepared and multiplied.

A `QuantConfig` picks each linear layer's method when the layer is built, from the engine's configuration and the
checkpoint (vLLM's `QuantizationConfig.get_quant_method`); the layer then holds whatever the method creates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn


class LinearMethodBase(ABC):
    """Storage and matmul of one linear layer: y = x W^T + b, read and returned in `input_dtype`."""

    input_dtype: torch.dtype  # what apply() reads: the op before the layer emits this dtype (fused cast)
    weight_format: str  # float32 | float16 | bfloat16 | q4_1 | q8_0 (reported by tests and `pagemill env`)

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        """Register the layer's weight storage (its bias, if any, is the layer's own)."""

    @abstractmethod
    def load_weight(self, layer: nn.Module, loaded: Any, row_offset: int, shard_index: int) -> None:
        """Store a checkpoint tensor (torch.Tensor or a lazy GGUF weight) as rows [row_offset, + rows) of W."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded weight into the form apply() reads (prepacked, records, ...)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] (in input_dtype) -> [T, out]."""

    @abstractmethod
    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight [out, in] as floats (tests, debugging): exactly the values apply() multiplies by."""


class QuantConfig(ABC):
    """Chooses each linear layer's method from the engine's configuration and the checkpoint."""

    @abstractmethod
    def get_linear_method(self, checkpoint_names: list[str], in_features: int) -> LinearMethodBase:
        """The method for a layer made of these checkpoint weights (HF names; several for a fused layer)."""


def copy_into(dst: torch.Tensor, loaded: Any) -> None:
    """dst <- a checkpoint tensor: a torch.Tensor, or a lazy weight with `load_into(out)` (GGUF) that decodes
    straight into a contiguous float32 destination (else through a temporary)."""
    if tuple(dst.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(dst.shape)}.")
    with torch.no_grad():
        if isinstance(loaded, torch.Tensor):
            dst.copy_(loaded)
        elif dst.dtype == torch.float32 and dst.is_contiguous():
            loaded.load_into(dst)
        else:
            dst.copy_(loaded.materialize())
