"""Linear methods (float, prepacked, GGUF blocks, int8/int4 weight-only) and the engine options that choose them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagemill.config import CHECKPOINT_QUANTIZATIONS, WEIGHT_ONLY_QUANTIZATIONS, check_linear_options
from pagemill.layers.quantization.base import LinearMethodBase, QuantConfig
from pagemill.layers.quantization.dense import DenseQuantConfig

if TYPE_CHECKING:
    from pagemill.kernels.ops import TorchLayerOps

__all__ = ["LinearMethodBase", "QuantConfig", "get_quant_config"]


def get_quant_config(linear_dtype: str, quantization: str, model_dtype: torch.dtype, ops: TorchLayerOps,
                     gguf_tensor_types: dict[str, int] | None = None, records_cache: Any = None,
                     checkpoint: Any = None, tensor_dtypes: dict[str, torch.dtype] | None = None) -> QuantConfig:
    """The chooser of every linear layer's method (run with the layer-ops table `ops`), from the engine options,
    the weight files' records cache (records_cache.RecordsCache, or None: layouts packed by earlier starts) and
    (GGUF) the file's tensor table, or (a GPTQ / AWQ / compressed-tensors / FP8 checkpoint) the loader's
    QuantizedCheckpoint; `tensor_dtypes` (a safetensors checkpoint's stored dtypes by name; a GGUF file's come from
    its tensor table) lets float16 / bfloat16 weights stay 16-bit."""
    check_linear_options(linear_dtype, quantization)
    if quantization in WEIGHT_ONLY_QUANTIZATIONS and gguf_tensor_types is not None:
        raise ValueError(f"quantization={quantization!r} quantizes a float checkpoint; a GGUF file is already "
                         "quantized.")
    int8_activations = linear_dtype == "int8"
    if int8_activations and (not ops.linear_kernels or quantization not in ("gguf", *WEIGHT_ONLY_QUANTIZATIONS,
                                                                   *CHECKPOINT_QUANTIZATIONS)):
        raise ValueError("linear_dtype='int8' multiplies int8 activations with quantized weights in pagemill's "
                         "compiled kernels: it needs a GGUF model, a GPTQ / AWQ / compressed-tensors checkpoint or "
                         "quantization='int8' / 'int4', and the kernels "
                         f"(got quantization={quantization!r}{'' if ops.linear_kernels else ', no kernels'}).")
    dtype = model_dtype if linear_dtype in ("auto", "int8") else getattr(torch, linear_dtype)
    if gguf_tensor_types is not None:
        from pagemill.layers.quantization.half_tiles import GGUF_FLOAT_DTYPES

        tensor_dtypes = {n: GGUF_FLOAT_DTYPES.get(t) for n, t in gguf_tensor_types.items()}
    dense = DenseQuantConfig(dtype, model_dtype, ops, prepack=quantization == "gguf",
                             int8_activations=int8_activations, tensor_dtypes=tensor_dtypes,
                             records_cache=records_cache)
    if quantization == "gguf":
        from pagemill.layers.quantization.gguf import GGUFQuantConfig

        return GGUFQuantConfig(gguf_tensor_types or {}, dense, records_cache)
    if quantization in CHECKPOINT_QUANTIZATIONS:
        from pagemill.layers.quantization.prequantized import checkpoint_quant_config

        if checkpoint is None:
            raise ValueError(f"quantization={quantization!r} needs the quantized checkpoint's tensors.")
        return checkpoint_quant_config(checkpoint.spec, checkpoint.quantized_weights, dense, records_cache)
    if quantization in WEIGHT_ONLY_QUANTIZATIONS:
        from pagemill.layers.quantization.weight_only import WeightOnlyQuantConfig

        return WeightOnlyQuantConfig(quantization, dense)
    return dense
