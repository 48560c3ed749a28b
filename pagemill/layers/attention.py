"""The Attention layer models call; the backend it was built with computes it over the KV cache the runner binds."""

from __future__ import annotations

import torch
from torch import nn

from pagemill.forward_context import get_attn_metadata
from pagemill.layers.context import LayerContext
from pagemill.layers.norm import RMSNorm
from pagemill.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Paged attention from a fused QKV projection output: optional per-head QK norm, RoPE, cache write, attend.

    The path is chosen once, from the backend's declared capabilities: its fused RoPE + cache-write kernel when it
    has one for this layer (dtype, full-width RoPE, and a QK norm only if the kernel takes one), else split, norm,
    rotate and `backend.forward`.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, ctx: LayerContext,
                 rotary: RotaryEmbedding, out_dtype: torch.dtype, sliding_window: int | None = None,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, layer_idx: int = 0) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.sliding_window, self.layer_idx = scale, sliding_window, layer_idx
        self.rotary, self.out_dtype = rotary, out_dtype
        # The norms belong to the caller's module (their weights load there); a tuple keeps them unregistered here.
        self.qk_norm = None if q_norm is None else (q_norm, k_norm)
        self.backend = ctx.attn_backend
        caps = self.backend.capabilities
        if sliding_window is not None and not caps.sliding_window:
            raise ValueError(f"the {self.backend.name} attention backend has no sliding-window attention.")
        self.fused = (caps.fused_rope_cache_write and rotary.rotary_dim == head_dim
                      and rotary.cos.dtype in caps.fused_dtypes and (q_norm is None or caps.qk_norm_hook))
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner
        self.kv_cache_group = 0  # which KV cache group's block table this layer reads (set by the runner)

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hk) * D] -> [T, Hq * D] in out_dtype."""
        t = qkv.shape[0]
        metadata = get_attn_metadata()[self.kv_cache_group]
        if self.fused:
            out = self.backend.forward_fused(self, qkv, positions, self.rotary.cos, self.rotary.sin, self.kv_cache,
                                             metadata, self.out_dtype)
            return out.view(t, self.q_size)
        q, k, v = qkv.to(self.rotary.cos.dtype).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            q, k = self.qk_norm[0](q), self.qk_norm[1](k)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(self, q, k, v.view(t, self.num_kv_heads, self.head_dim), self.kv_cache, metadata)
        return out.reshape(t, self.q_size).to(self.out_dtype)
