"""Rotary position embedding with a precomputed cos/sin table indexed by position."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from collections.abc import Callable

import torch
from torch import nn

from pagemill.config.config_snapshot import ConfigSnapshot, as_transformers_config
from pagemill.platforms import current_platform
from pagemill.utils.cache_dirs import (METADATA_CACHE_MAX_GIB, cache_limit_bytes, mark_used, metadata_cache_dir,
                                       metadata_cache_enabled, write_atomically)

logger = logging.getLogger(__name__)

_ROPE_CACHE_FORMAT = 1  # of the saved tables


def _inv_freq(hf_config, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE type (HF's own init functions).

    `layer_type`: for configs with RoPE parameters per layer type (Gemma 3: sliding / full attention).
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    device = current_platform.device
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        dim = int(dim * params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError(f"rope type {rope_type!r} is not supported.")

    def build() -> tuple[torch.Tensor, float]:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"rope type {rope_type!r} is not supported.")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](as_transformers_config(hf_config), device,
                                                           layer_type=layer_type)
        return inv_freq, float(scaling)

    return _cached_rope(hf_config, layer_type, device, build)


def _cached_rope(hf_config, layer_type: str | None, device: torch.device,
                 build: Callable[[], tuple[torch.Tensor, float]]) -> tuple[torch.Tensor, float]:
    """build()'s (inv_freq, attention scaling), saved in the metadata cache by the config's contents: transformers'
    init functions need the model's configuration class, whose import is most of a later start's model build
    (~0.7-1.4 s for Llama 3's "llama3" RoPE). A transformers config object (not a snapshot) is built directly."""
    if not isinstance(hf_config, ConfigSnapshot) or not metadata_cache_enabled():
        return build()
    key = json.dumps([_ROPE_CACHE_FORMAT, hf_config.to_dict(), layer_type, torch.device(device).type,
                      importlib.metadata.version("transformers")], sort_keys=True, default=str)
    path = metadata_cache_dir() / f"rope-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            inv_freq = torch.tensor(data["inv_freq_bits"], dtype=torch.int32).view(torch.float32)
            mark_used(path)
            return inv_freq.to(device), float.fromhex(data["scaling"])
        except Exception as e:  # noqa: BLE001 - a damaged cache file is rebuilt, never fatal
            logger.warning("Ignoring the unreadable RoPE cache %s (%s)", path, e)
    inv_freq, scaling = build()
    bits = inv_freq.detach().to("cpu", torch.float32).contiguous().view(torch.int32).tolist()
    write_atomically(path, json.dumps({"inv_freq_bits": bits, "scaling": scaling.hex()}).encode(),
                     cache_limit_bytes("PAGEMILL_METADATA_CACHE_MAX_GB", METADATA_CACHE_MAX_GIB))
    return inv_freq, scaling


class RotaryEmbedding(nn.Module):
    """Applies RoPE (the non-interleaved "rotate_half" form HF Llama uses) to q and k."""

    def __init__(self, hf_config, max_position: int, dtype: torch.dtype, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scaling = _inv_freq(hf_config, layer_type)
        pos = torch.arange(max_position, dtype=torch.float, device=inv_freq.device)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rotary_dim = emb.shape[-1]
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)
        # layer ops with a fused `rotary` (the GPU runner's Triton ops set it after loading); None: the torch math
        self.kernel_ops = None

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]. With a partial rotary factor only the first rotary_dim
        features of each head rotate (Phi-3.5 / Phi-4-mini); the rest pass through."""
        if self.kernel_ops is not None and q.dim() == 3:
            return self.kernel_ops.rotary(positions, q, k, self.cos, self.sin, self.rotary_dim)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        d = self.rotary_dim
        if d == q.shape[-1]:
            return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
        q_rot, k_rot = q[..., :d], k[..., :d]
        return (torch.cat((q_rot * cos + self._rotate_half(q_rot) * sin, q[..., d:]), dim=-1),
                torch.cat((k_rot * cos + self._rotate_half(k_rot) * sin, k[..., d:]), dim=-1))
