"""Bidirectional attention for encoder-only models: every token sees every token of its own request, no KV cache.

The runner puts one `EncoderAttentionMetadata` in the forward context per step. The flattened tokens are laid out
as a padded [requests, longest] batch for one `scaled_dot_product_attention` call whose key mask hides the
padding; requests are grouped by length first (`length_groups`), so the padding stays a small fraction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagemill.forward_context import get_attn_metadata

# A group of requests is padded to its longest; a new group starts when padding would exceed this fraction of
# the group's real tokens.
MAX_PADDING_FRACTION = 0.25


@dataclass
class AttentionGroup:
    """Requests attended together in one padded batch."""

    num_reqs: int
    max_len: int
    token_rows: torch.Tensor  # [tokens of the group] rows of the flattened batch, request after request
    padded_index: torch.Tensor  # [tokens of the group] where each sits in the padded [num_reqs * max_len] layout
    key_mask: torch.Tensor | None  # [num_reqs, 1, 1, max_len], True for real tokens (None: no padding)


@dataclass
class EncoderAttentionMetadata:
    """Where each request's tokens sit in the step's flattened batch, grouped for attention."""

    num_tokens: int
    groups: list[AttentionGroup]

    @classmethod
    def build(cls, counts: np.ndarray) -> EncoderAttentionMetadata:
        """From the token count of each request, whose tokens are consecutive in the batch in this order."""
        starts = np.cumsum(counts) - counts
        groups = [_group(starts[idx], counts[idx]) for idx in length_groups(counts)]
        return cls(int(counts.sum()), groups)


def length_groups(counts: np.ndarray, max_padding: float = MAX_PADDING_FRACTION) -> list[np.ndarray]:
    """Request indices split into groups of similar length (by length, longest first), each padded to its
    longest with at most `max_padding` of its real tokens."""
    order = np.argsort(-counts, kind="stable")
    groups, current, real = [], [], 0
    for i in order:
        n = int(counts[i])
        if current and (len(current) + 1) * int(counts[current[0]]) > (1 + max_padding) * (real + n):
            groups.append(np.array(current))
            current, real = [], 0
        current.append(i)
        real += n
    groups.append(np.array(current))
    return groups


def _group(starts: np.ndarray, counts: np.ndarray) -> AttentionGroup:
    max_len = int(counts.max())
    req = np.repeat(np.arange(len(counts)), counts)
    offset = np.arange(int(counts.sum())) - (np.cumsum(counts) - counts)[req]
    mask = None
    if (counts != max_len).any():
        mask = torch.from_numpy(np.arange(max_len)[None, :] < counts[:, None]).view(len(counts), 1, 1, max_len)
    return AttentionGroup(len(counts), max_len, torch.from_numpy(starts[req] + offset),
                          torch.from_numpy(req * max_len + offset), mask)


class EncoderAttention(nn.Module):
    """softmax(q k^T * scale) v within each request, from a fused QKV projection's output."""

    def __init__(self, num_heads: int, head_dim: int, scale: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, 3 * H * D] (q | k | v) -> [T, H * D]."""
        md: EncoderAttentionMetadata = get_attn_metadata()[0]
        width = self.num_heads * self.head_dim
        if len(md.groups) == 1 and md.groups[0].key_mask is None:  # requests of one length: no copies
            return self._attend(qkv.view(md.groups[0].num_reqs, -1, 3 * width), None)
        out = qkv.new_empty(md.num_tokens, width)
        for g in md.groups:
            padded = qkv.new_zeros(g.num_reqs * g.max_len, 3 * width)
            padded.index_copy_(0, g.padded_index, qkv.index_select(0, g.token_rows))
            attended = self._attend(padded.view(g.num_reqs, g.max_len, 3 * width), g.key_mask)
            out.index_copy_(0, g.token_rows, attended.index_select(0, g.padded_index))
        return out

    def _attend(self, qkv: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """[B, L, 3 * H * D] -> [B * L, H * D]."""
        b, n = qkv.shape[:2]
        q, k, v = qkv.view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=self.scale)
        return out.transpose(1, 2).reshape(b * n, self.num_heads * self.head_dim)
