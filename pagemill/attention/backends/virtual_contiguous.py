"""Attention over virtual-contiguous KV (kv_cache_layout="virtual"): each request's K and V are one contiguous array.

New K/V are written into the physical pool by slot mapping (the pool has the paged layout, so copy-on-write, swap
and prefix caching work on blocks unchanged); attention reads each request's range (worker/virtual_kv.py), which
maps the same physical chunks, with torch SDPA on strided views: no block table and no gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagemill.attention.backend import AttentionBackend, AttentionCapabilities
from pagemill.attention.metadata import CommonAttentionMetadata

# Decodes run as one padded SDPA call over a window of slots when at least this share of the window decodes.
_MIN_WINDOW_DENSITY = 0.5


@dataclass
class VirtualAttentionMetadata:
    """The common metadata plus the decodes' slot window and its mask (built once per step)."""

    common: CommonAttentionMetadata
    slots: np.ndarray  # [B] the input-batch row (virtual range) of each request
    window: tuple[int, int] | None = None  # (first slot, slots) of the batched decode call; None: one call each
    decode_index: torch.Tensor | None = None  # [D] position of each decode in the window
    decode_mask: torch.Tensor | None = None  # [W, 1, 1, max_kv]
    max_kv: int = 0


class VirtualContiguousAttention(AttentionBackend):
    """SDPA over each request's contiguous virtual K/V; decodes batched over a window of slots, others one by one."""

    name = "virtual"
    capabilities = AttentionCapabilities(sliding_window=False)
    batch_order = (0, 1, 1)  # decodes first

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The physical pool per layer: [2 (K/V), num_blocks, block_size, kv_heads, head_dim] (chunks = blocks)."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, common: CommonAttentionMetadata) -> VirtualAttentionMetadata:
        """Choose how the decodes run: one padded call over their slot window when it is dense enough."""
        if common.rows is None:
            raise ValueError("kv_cache_layout='virtual' needs the input-batch rows in the attention metadata.")
        md = VirtualAttentionMetadata(common, common.rows)
        d = common.num_decodes
        if d > 1:
            slots = md.slots[:d]
            lo, hi = int(slots.min()), int(slots.max())
            width = hi - lo + 1
            if d >= _MIN_WINDOW_DENSITY * width:
                max_kv = int(common.seq_lens[:d].max())
                lens = np.ones(width, dtype=np.int64)  # rows of the window that are not decodes attend to key 0
                lens[slots - lo] = common.seq_lens[:d]
                mask = np.arange(max_kv)[None, :] < lens[:, None]
                md.window, md.max_kv = (lo, width), max_kv
                md.decode_index = torch.from_numpy(slots - lo)
                md.decode_mask = torch.from_numpy(mask)[:, None, None, :]
        return md

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: VirtualAttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq, D]; layer.virtual_kv holds its (K, V) range views."""
        md = metadata.common
        n = md.num_actual_tokens
        hk, hd = layer.num_kv_heads, layer.head_dim
        kv_cache[0].view(-1, hk, hd).index_copy_(0, md.slot_mapping, k[:n].to(kv_cache.dtype))
        kv_cache[1].view(-1, hk, hd).index_copy_(0, md.slot_mapping, v[:n].to(kv_cache.dtype))
        k_range, v_range = layer.virtual_kv
        out = torch.empty_like(q)
        group = layer.num_heads // hk
        d = md.num_decodes
        if metadata.window is not None:
            lo, width = metadata.window
            kw = k_range[lo:lo + width, :metadata.max_kv].transpose(1, 2).to(q.dtype)  # [W, Hk, S, D], a view
            vw = v_range[lo:lo + width, :metadata.max_kv].transpose(1, 2).to(q.dtype)
            qw = q.new_zeros(width, hk, group, hd)
            # GQA without repeating K/V: the `group` query heads of a KV head are its query rows.
            qw[metadata.decode_index] = q[:d].view(d, hk, group, hd)
            o = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=metadata.decode_mask, scale=layer.scale)
            out[:d] = o[metadata.decode_index].reshape(d, layer.num_heads, hd)
            first = d
        else:
            first = 0
        qsl = md.query_start_loc
        for i in range(first, md.num_reqs):
            s, e = int(qsl[i]), int(qsl[i + 1])
            slot, seq, ctx = int(metadata.slots[i]), int(md.seq_lens[i]), int(md.num_computed_tokens[i])
            ki = k_range[slot, :seq].transpose(0, 1).to(q.dtype)  # [Hk, seq, D], contiguous in tokens
            vi = v_range[slot, :seq].transpose(0, 1).to(q.dtype)
            if e - s == 1:  # a decode: its query heads as rows per KV head, every key visible (4-d: SDPA's fast path)
                o = F.scaled_dot_product_attention(q[s].view(1, hk, group, hd), ki.unsqueeze(0), vi.unsqueeze(0),
                                                   scale=layer.scale)
                out[s] = o.reshape(layer.num_heads, hd)
                continue
            qi = q[s:e].transpose(0, 1)  # [Hq, L, D]
            if ctx == 0:
                o = F.scaled_dot_product_attention(qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), is_causal=True,
                                                   scale=layer.scale, enable_gqa=True)
            else:
                mask = torch.ones(e - s, seq, dtype=torch.bool).tril_(ctx)  # query t sees keys <= ctx + t
                o = F.scaled_dot_product_attention(qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), attn_mask=mask,
                                                   scale=layer.scale, enable_gqa=True)
            out[s:e] = o[0].transpose(0, 1)
        return out
