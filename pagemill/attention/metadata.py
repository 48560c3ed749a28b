"""Per-step attention metadata common to every backend (built once per step by the runner)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """Where each request's tokens sit in the flattened batch and in the paged KV cache (one per KV cache group).

    Requests are in the order the backend asked for (`AttentionBackend.batch_order`): decodes first.
    """

    num_reqs: int
    num_decodes: int  # requests with one new token (the first num_decodes)
    num_actual_tokens: int
    query_start_loc: np.ndarray  # [B + 1]
    seq_lens: np.ndarray  # [B] tokens in the KV cache after this step
    num_computed_tokens: np.ndarray  # [B] tokens in the KV cache before this step
    # [B, max_blocks] block ids of this metadata's KV cache group (0 = null block pads). For a sliding-window group
    # the entries wholly before a request's window may name blocks the pool has since given to others: a backend
    # never lets keys outside the window contribute (mask or skip them).
    block_table: np.ndarray
    block_size: int
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    rows: np.ndarray | None = None  # [B] input-batch row of each request (kv_cache_layout="virtual": its KV range)
    # (block table int32 [B, max_blocks], token's request int32 [T], token's position int32 [T]) already on the
    # model's device, in the GPU runner's persistent buffers (backends that need them read these, else make them)
    device_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # [T] keys [0, limit) each new token attends to, where a token sees past its own position: a placeholder token
    # of a model whose image tokens attend bidirectionally sees its whole image (None: causal, limit = position + 1)
    key_limits: np.ndarray | None = None

    def span_limits(self, i: int) -> np.ndarray | None:
        """Request i's key limits if any of its new tokens sees past its own position, else None (causal)."""
        if self.key_limits is None:
            return None
        s, e = int(self.query_start_loc[i]), int(self.query_start_loc[i + 1])
        limits = self.key_limits[s:e]
        causal = int(self.num_computed_tokens[i]) + 1 + np.arange(e - s)
        return None if np.array_equal(limits, causal) else limits
