"""Build a model from its config and load its weights in the engine's dtype."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from pagemill.config import ModelConfig
from pagemill.layers.linear import convert_linears
from pagemill.models.registry import get_model_class

logger = logging.getLogger(__name__)


def load_model(model_config: ModelConfig) -> nn.Module:
    """Instantiate the registered class for the model and fill in its weights."""
    from pagemill.loader.gguf_loader import iter_gguf_weights
    from pagemill.loader.safetensors_loader import iter_hf_weights

    cls = get_model_class(model_config.hf_config)
    start = time.perf_counter()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device("meta"):
            model = cls(model_config.hf_config, model_config.max_model_len, model_config.dtype)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device="cpu")
    # Buffers (RoPE tables) were created on meta; rebuild them for real.
    _rebuild_buffers(model, model_config)
    if model_config.gguf_file:
        weights = iter_gguf_weights(model_config.gguf_file, model_config.hf_config)
    else:
        weights = iter_hf_weights(model_config.model)
    model.load_weights((n, t.to(model_config.dtype)) for n, t in weights)
    model.eval().requires_grad_(False)
    convert_linears(model, model_config.linear_dtype, model_config.dtype, model_config.quantization)
    logger.info("Loaded %s (%s) in %.1fs", cls.__name__, model_config.dtype, time.perf_counter() - start)
    return model


def _rebuild_buffers(model: nn.Module, model_config: ModelConfig) -> None:
    """Recompute non-persistent buffers that meta-device construction left empty."""
    from pagemill.layers.rotary import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            fresh = RotaryEmbedding(model_config.hf_config, model_config.max_model_len, model_config.dtype)
            module.cos, module.sin = fresh.cos, fresh.sin
