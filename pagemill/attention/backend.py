"""The attention-backend contract: what a backend declares and what the runner and the Attention layer ask it.

A backend declares its KV-cache layout, the order it needs requests in within a step, and its capabilities; it
builds its own typed metadata from the runner's `CommonAttentionMetadata` once per step, and computes attention
for one layer from that metadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from pagemill.attention.metadata import CommonAttentionMetadata

# The kinds of request in a step, as the runner classifies them.
DECODE = 0  # one new token (whatever the context)
CONTEXT_CHUNK = 1  # several new tokens after cached context (a prefill chunk, a prefix-cache hit)
FRESH_PREFILL = 2  # several new tokens, nothing cached yet


def batch_permutation(num_scheduled: np.ndarray, num_computed: np.ndarray,
                      batch_order: tuple[int, int, int], group: np.ndarray | None = None) -> np.ndarray:
    """The order (indices) to put a step's requests in for a backend: by the rank its `batch_order` gives each
    request's kind, then by `group` if given (e.g. the LoRA adapter, so each adapter's tokens are contiguous),
    keeping the scheduler's order within those."""
    kind = np.where(num_scheduled == 1, DECODE, np.where(num_computed > 0, CONTEXT_CHUNK, FRESH_PREFILL))
    rank = np.asarray(batch_order)[kind]
    if group is not None:
        return np.lexsort((group, rank))
    return np.argsort(rank, kind="stable")


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend can do, so layers and the runner choose paths by asking rather than by backend name."""

    fused_rope_cache_write: bool = False  # forward_fused(): RoPE + KV-cache write + attention from the QKV output
    fused_dtypes: tuple[torch.dtype, ...] = ()  # query / RoPE-table dtypes forward_fused() takes
    qk_norm_hook: bool = False  # forward_fused() can apply a per-head QK norm before RoPE
    sliding_window: bool = True
    key_limits: bool = False  # reads CommonAttentionMetadata.key_limits (image tokens that see their whole image)
    kv_cache_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


# What a backend that reads quantized rows (attention/kv_quant.py) lists in its kv_cache_dtypes.
FLOAT_AND_QUANT_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
                             torch.int8)


class AttentionBackend(ABC):
    """One way of computing paged attention over a layer's KV cache."""

    name: ClassVar[str]
    capabilities: ClassVar[AttentionCapabilities]
    # Rank of DECODE, CONTEXT_CHUNK, FRESH_PREFILL in the batch order this backend needs (the runner sorts a step's
    # requests by it, stably).
    batch_order: ClassVar[tuple[int, int, int]]

    @staticmethod
    @abstractmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's KV cache."""

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """This backend's metadata for a step (built once, read by every layer)."""

    @abstractmethod
    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any) -> torch.Tensor:
        """Write the step's k, v [T, Hk, D] into the cache and attend: q [T, Hq, D] -> [T, Hq, D]."""

    def forward_fused(self, layer: Any, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
                      out_dtype: torch.dtype) -> torch.Tensor:
        """RoPE + cache write + attention from the fused QKV output [T, (Hq + 2 Hk) D] -> [T, Hq, D] in out_dtype
        (backends whose capabilities say fused_rope_cache_write)."""
        raise NotImplementedError(f"the {self.name} attention backend has no fused RoPE + cache-write path")
