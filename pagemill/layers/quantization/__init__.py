"""Linear methods (float, prepacked, GGUF blocks) and the engine options that choose them."""

from __future__ import annotations

from typing import Any

import torch

from pagemill.config import check_linear_options
from pagemill.layers.quantization.base import LinearMethodBase, QuantConfig
from pagemill.layers.quantization.dense import DenseQuantConfig

__all__ = ["LinearMethodBase", "QuantConfig", "get_quant_config"]


def get_quant_config(linear_dtype: str, quantization: str, model_dtype: torch.dtype, kernels: Any,
                     gguf_tensor_types: dict[str, int] | None = None) -> QuantConfig:
    """The chooser of every linear layer's method, from the engine options and (GGUF) the file's tensor table."""
    check_linear_options(linear_dtype, quantization)
    dtype = model_dtype if linear_dtype == "auto" else getattr(torch, linear_dtype)
    dense = DenseQuantConfig(dtype, model_dtype, kernels, prepack=quantization == "gguf")
    if quantization == "gguf":
        from pagemill.layers.quantization.gguf import GGUFQuantConfig

        return GGUFQuantConfig(gguf_tensor_types or {}, dense)
    return dense
