"""The Attention layer models call; the backend and the KV cache behind it are the runner's business."""

from __future__ import annotations

import torch
from torch import nn

from pagemill.forward_context import get_attn_metadata


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq * D]."""
        out = self.backend.forward(self, q, k, v, self.kv_cache, get_attn_metadata())
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
