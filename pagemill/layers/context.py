"""What every layer is built with: the engine's choices that decide how the model computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagemill.distributed.parallel_state import ParallelContext

if TYPE_CHECKING:
    from pagemill.attention.backend import AttentionBackend
    from pagemill.kernels.ops import TorchLayerOps
    from pagemill.layers.quantization.base import QuantConfig


@dataclass(frozen=True)
class LayerContext:
    """The model dtype, the fused-op implementation, the linear methods' chooser, the attention backend, and this
    process's tensor- and pipeline-parallel ranks (vLLM passes the same through `vllm_config` and `quant_config`)."""

    dtype: torch.dtype  # the residual stream, norms, embeddings, attention
    max_position: int  # RoPE tables cover positions below this
    ops: TorchLayerOps
    quant_config: QuantConfig
    attn_backend: AttentionBackend
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # the GroupCoordinator the row-parallel all-reduces run in
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def parallel(self) -> ParallelContext:
        """The ranks and group as one object (pipeline send / receive)."""
        return ParallelContext(self.tp_rank, self.tp_size, self.pp_rank, self.pp_size, self.tp_group)
