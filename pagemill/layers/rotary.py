"""Rotary position embedding with a precomputed cos/sin table indexed by position."""

from __future__ import annotations

import torch
from torch import nn

from pagemill.config.config_snapshot import as_transformers_config
from pagemill.platforms import current_platform


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
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"rope type {rope_type!r} is not supported.")
    return ROPE_INIT_FUNCTIONS[rope_type](as_transformers_config(hf_config), device, layer_type=layer_type)


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
