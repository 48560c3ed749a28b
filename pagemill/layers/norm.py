"""RMSNorm computed as HF transformers does (in float32), optionally fused with the residual add."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagemill.kernels.ops import TorchLayerOps
from pagemill.layers.quantization.base import copy_into


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale; with `residual`, adds x into it first (vLLM style).

    `out_dtype`: what the consumer reads (the next matmul's input dtype), cast inside the op. `one_plus`: the
    scale is (1 + w) (Gemma), folded into the weight once at load.
    """

    def __init__(self, hidden_size: int, eps: float, ops: TorchLayerOps, out_dtype: torch.dtype | None = None,
                 one_plus: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps, self.ops, self.out_dtype, self.one_plus = eps, ops, out_dtype, one_plus

    def load_weight(self, param: str, loaded: Any, shard_id: Any = None) -> None:
        """The checkpoint's w (the stored scale is 1 + w when one_plus)."""
        copy_into(self.weight, loaded)
        if self.one_plus:
            self.weight.data += 1.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        out_dtype = self.out_dtype or x.dtype
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps, out_dtype)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps, out_dtype)
