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
    from pagemill.loader.gguf_loader import GGUFWeights
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
    gguf_weights = None
    if model_config.gguf_file:
        gguf_weights = GGUFWeights(model_config.gguf_file, model_config.hf_config)
        if model_config.dtype == torch.float32:  # decoded straight into the parameters: no temporaries
            model.load_weights(gguf_weights.lazy())
        else:
            model.load_weights((n, t.to(model_config.dtype)) for n, t in gguf_weights)
    else:
        model.load_weights((n, t.to(model_config.dtype)) for n, t in iter_hf_weights(model_config.model))
    model.eval().requires_grad_(False)
    if gguf_weights is not None:  # read again, one linear at a time, when packed below
        gguf_weights.gguf.release_pages()
    loaded = time.perf_counter()
    blocks = _blocks_by_parameter(model, gguf_weights.blocks) if gguf_weights is not None else None
    convert_linears(model, model_config.linear_dtype, model_config.dtype, model_config.quantization, blocks)
    if gguf_weights is not None:
        gguf_weights.gguf.release_pages()  # the file no longer counts in the resident set
    logger.info("Loaded %s (%s) in %.1fs (weights %.1fs, linear packing %.1fs)", cls.__name__, model_config.dtype,
                time.perf_counter() - start, loaded - start, time.perf_counter() - loaded)
    return model


def _blocks_by_parameter(model: nn.Module, blocks: dict) -> dict:
    """The GGUF blocks of each model parameter, from those of the checkpoint tensors (HF names) it is made of.

    A fused parameter (qkv_proj, gate_up_proj) gets its parts' blocks in row order when all its rows come from
    blocks of one type; otherwise it gets none (its linear then fits the dequantized weight, as before).
    """
    target = getattr(model, "weight_target", None)
    if target is None or not blocks:
        return {}
    parts: dict[str, list] = {}
    for hf_name, b in blocks.items():
        placement = target(hf_name)
        if placement is not None:
            name, offset, _ = placement
            parts.setdefault(name, []).append((offset, b))
    params = dict(model.named_parameters())
    out = {}
    for name, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        first = pieces[0][1]
        rows, ok = 0, True
        for offset, b in pieces:
            ok &= offset == rows and b.ggml_type == first.ggml_type
            rows += b.shape[0]
        if ok and name in params and params[name].dim() == 2 and rows == params[name].shape[0]:
            out[name] = first.fuse(*(b for _, b in pieces[1:]))
    return out


def _rebuild_buffers(model: nn.Module, model_config: ModelConfig) -> None:
    """Recompute non-persistent buffers that meta-device construction left empty."""
    from pagemill.layers.rotary import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            fresh = RotaryEmbedding(model_config.hf_config, model_config.max_model_len, model_config.dtype)
            module.cos, module.sin = fresh.cos, fresh.sin
