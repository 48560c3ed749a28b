"""Per-step attention metadata common to every backend (built once per step by the runner)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """Where each request's tokens sit in the flattened batch and in the paged KV cache.

    Requests are in the order the backend asked for (`AttentionBackend.batch_order`): decodes first.
    """

    num_reqs: int
    num_decodes: int  # requests with one new token (the first num_decodes)
    num_actual_tokens: int
    query_start_loc: np.ndarray  # [B + 1]
    seq_lens: np.ndarray  # [B] tokens in the KV cache after this step
    num_computed_tokens: np.ndarray  # [B] tokens in the KV cache before this step
    block_table: np.ndarray  # [B, max_blocks] block ids (0 = null block pads)
    block_size: int
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
