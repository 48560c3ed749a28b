"""RMSNorm computed as HF transformers does (in float32), optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from pagemill.kernels import ops


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale; with `residual`, adds x into it first (vLLM style)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or (norm(x + residual), x + residual) when a residual is given; output in `out_dtype`."""
        out_dtype = out_dtype or x.dtype
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, out_dtype)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, out_dtype)
