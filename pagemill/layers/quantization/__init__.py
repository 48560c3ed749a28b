"""Linear methods (float, prepacked, GGUF blocks) and the engine options that choose them."""

from __future__ import annotations

from typing import Any

import torch

from pagemill.layers.quantization.base import LinearMethodBase, QuantConfig
from pagemill.layers.quantization.dense import DenseQuantConfig

LINEAR_DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("auto", "none", "gguf")

__all__ = ["LINEAR_DTYPES", "QUANTIZATIONS", "LinearMethodBase", "QuantConfig", "check_linear_options",
           "get_quant_config", "resolve_quantization"]


def check_linear_options(linear_dtype: str, quantization: str) -> None:
    """Raise a ValueError naming the field for an unknown linear_dtype or quantization."""
    if linear_dtype not in LINEAR_DTYPES:
        raise ValueError(f"linear_dtype must be one of {', '.join(LINEAR_DTYPES)}, got {linear_dtype!r}.")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}.")


def resolve_quantization(quantization: str, from_gguf: bool) -> str:
    """auto = keep GGUF weights in their block formats (it changes no weight value), else none; gguf needs a GGUF
    file (the blocks are read from it)."""
    if quantization == "auto":
        return "gguf" if from_gguf else "none"
    if quantization == "gguf" and not from_gguf:
        raise ValueError("quantization='gguf' needs a GGUF model file (the blocks are read from it).")
    return quantization


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
