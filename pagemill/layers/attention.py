"""The Attention layer models call; the backend and the KV cache behind it are the runner's business."""

from __future__ import annotations

import torch
from torch import nn

from pagemill.forward_context import get_attn_metadata
from pagemill.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Paged attention over this layer's KV cache, using the step's metadata from the forward context."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, layer_idx: int = 0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.layer_idx = layer_idx
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner
        self.backend = None  # bound by the model runner

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                    out_dtype: torch.dtype) -> torch.Tensor:
        """Attention from a fused QKV projection output [T, (Hq + 2 Hk) * D]: RoPE, cache write, attend.

        Returns [T, Hq * D] in `out_dtype`. Backends with a fused RoPE + cache-write kernel take it whole.
        """
        fused = getattr(self.backend, "forward_fused", None)
        if fused is not None and rotary.cos.shape[-1] == self.head_dim:
            out = fused(self, qkv, positions, rotary.cos, rotary.sin, self.kv_cache, get_attn_metadata(), out_dtype)
            if out is not None:
                return out.view(qkv.shape[0], self.num_heads * self.head_dim)
        t = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.to(rotary.cos.dtype).split([q_size, kv_size, kv_size], dim=-1)
        q, k = rotary(positions, q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim))
        return self.forward(q, k, v.view(t, self.num_kv_heads, self.head_dim)).to(out_dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq * D]."""
        out = self.backend.forward(self, q, k, v, self.kv_cache, get_attn_metadata())
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
