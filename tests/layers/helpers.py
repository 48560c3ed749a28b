"""Building single layers the way an engine builds them, and reaching an engine's model in tests."""

from __future__ import annotations

import torch

from pagemill.attention.backends.torch_paged import TorchPagedAttention
from pagemill.kernels.ops import KernelLayerOps, TorchLayerOps
from pagemill.layers.context import LayerContext
from pagemill.layers.quantization import get_quant_config
from tests.conftest import require_kernels


def layer_context(kernels: bool = True, linear_dtype: str = "auto", quantization: str = "none",
                  dtype: torch.dtype = torch.float32, gguf_tensor_types: dict[str, int] | None = None,
                  tp_rank: int = 0, tp_size: int = 1) -> LayerContext:
    """A LayerContext with the kernel ops (or the torch reference) and the quant config the options choose."""
    ops = KernelLayerOps(require_kernels()) if kernels else TorchLayerOps()
    quant = get_quant_config(linear_dtype, quantization, dtype, ops, gguf_tensor_types)
    return LayerContext(dtype, 256, ops, quant, TorchPagedAttention(), tp_rank, tp_size)


def engine_model(llm):
    """The model an LLM runs (tests inspect its layers), through vLLM's `LLM.apply_model`."""
    return llm.apply_model(lambda model: model)[0]
