"""Reference paged attention in pure torch: write K/V by slot_mapping, gather blocks, run SDPA.

It is the correctness reference that faster backends are tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagemill.attention.backend import FLOAT_AND_QUANT_KV_DTYPES, AttentionBackend, AttentionCapabilities
from pagemill.attention.kv_quant import is_quantized, pack_rows, row_width, unpack_rows
from pagemill.attention.metadata import CommonAttentionMetadata


def _slots(block_table: np.ndarray, length: int, block_size: int) -> np.ndarray:
    """Slot ids of the first `length` tokens of every row of `block_table`: [B, length]."""
    j = np.arange(length)
    return block_table[:, j // block_size] * block_size + (j % block_size)


@dataclass
class TorchAttentionMetadata:
    """The common metadata plus gather indices and masks, built on first use per sliding window (layers of one
    model may differ) and shared by every layer of the step."""

    common: CommonAttentionMetadata
    _decode: dict = field(default_factory=dict)
    _prefill: dict = field(default_factory=dict)

    def decode_inputs(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot indices [D, max_kv], mask [D, 1, 1, max_kv]) of the decodes' cached keys."""
        if window not in self._decode:
            md = self.common
            d = md.num_decodes
            seq_lens = md.seq_lens[:d]
            max_kv = int(seq_lens.max())
            idx = torch.from_numpy(_slots(md.block_table[:d], max_kv, md.block_size).astype(np.int64))
            pos = np.arange(max_kv)[None, :]
            allowed = pos < seq_lens[:, None]
            if window is not None:
                allowed &= pos > (seq_lens[:, None] - 1 - window)
            self._decode[window] = (idx, torch.from_numpy(allowed)[:, None, None, :])
        return self._decode[window]

    def prefill_inputs(self, i: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot indices [seq], causal mask [q_len, seq]) of request i's cached and new keys."""
        key = (i, window)
        if key not in self._prefill:
            md = self.common
            ctx = int(md.num_computed_tokens[i])
            seq = int(md.seq_lens[i])
            idx = torch.from_numpy(_slots(md.block_table[i : i + 1], seq, md.block_size)[0].astype(np.int64))
            qpos = ctx + np.arange(seq - ctx)[:, None]
            kpos = np.arange(seq)[None, :]
            limits = md.span_limits(i)
            allowed = kpos <= qpos if limits is None else kpos < limits[:, None]
            if window is not None:
                allowed &= kpos > qpos - window
            self._prefill[key] = (idx, torch.from_numpy(allowed))
        return self._prefill[key]


class TorchPagedAttention(AttentionBackend):
    """Pure-torch paged attention backend (decodes batched in one SDPA call, prefills one by one)."""

    name = "torch"
    capabilities = AttentionCapabilities(kv_cache_dtypes=FLOAT_AND_QUANT_KV_DTYPES, key_limits=True)
    batch_order = (0, 1, 1)  # decodes first; chunks and prefills in any order

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Layout of one layer's cache: [2 (K/V), num_blocks, block_size, kv_heads, head_dim] (head_dim: the row width,
        kv_quant.row_width for a quantized cache)."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        """Gather indices and masks are built lazily, once per step and window."""
        return TorchAttentionMetadata(common)

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TorchAttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq, D]."""
        md = metadata.common
        n = md.num_actual_tokens
        if is_quantized(kv_cache.dtype):
            return self._forward_quantized(layer, q, k, v, kv_cache, metadata)
        k_cache = kv_cache[0].view(-1, layer.num_kv_heads, layer.head_dim)
        v_cache = kv_cache[1].view(-1, layer.num_kv_heads, layer.head_dim)
        k_cache.index_copy_(0, md.slot_mapping, k[:n].to(k_cache.dtype))
        v_cache.index_copy_(0, md.slot_mapping, v[:n].to(v_cache.dtype))
        if k_cache.dtype != q.dtype:  # reduced-precision cache: attend to what was stored, widened back
            k, v = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)
        # (named, not self._attend: the cpu backend's bfloat16 / float16 fallback lands here with its own _attend)
        return TorchPagedAttention._attend(layer, q, k, v, lambda idx: k_cache[idx].to(q.dtype),
                                           lambda idx: v_cache[idx].to(q.dtype), metadata)

    def _forward_quantized(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_cache: torch.Tensor, metadata: TorchAttentionMetadata) -> torch.Tensor:
        """The same with a quantized cache (attention/kv_quant.py): rows quantized on write, dequantized on read."""
        md = metadata.common
        n, dtype = md.num_actual_tokens, kv_cache.dtype
        width = row_width(layer.head_dim, dtype)
        rows = kv_cache.view(torch.uint8)
        k_rows = rows[0].view(-1, layer.num_kv_heads, width)
        v_rows = rows[1].view(-1, layer.num_kv_heads, width)
        k_new, v_new = pack_rows(k[:n], dtype), pack_rows(v[:n], dtype)
        k_rows.index_copy_(0, md.slot_mapping, k_new)
        v_rows.index_copy_(0, md.slot_mapping, v_new)
        k, v = unpack_rows(k_new, dtype, q.dtype), unpack_rows(v_new, dtype, q.dtype)
        return TorchPagedAttention._attend(layer, q, k, v, lambda idx: unpack_rows(k_rows[idx], dtype, q.dtype),
                                           lambda idx: unpack_rows(v_rows[idx], dtype, q.dtype), metadata)

    @staticmethod
    def _attend(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, read_k: Callable, read_v: Callable,
                metadata: TorchAttentionMetadata) -> torch.Tensor:
        """Attention over the step's k, v (as stored) and the cached keys `read_k(slots)` / `read_v(slots)` give."""
        md = metadata.common
        out = torch.empty_like(q)
        window = layer.sliding_window
        d = md.num_decodes
        if d:
            idx, mask = metadata.decode_inputs(window)
            kd = read_k(idx).transpose(1, 2)  # [D, Hk, max_kv, hd]
            vd = read_v(idx).transpose(1, 2)
            qd = q[:d].unsqueeze(2)  # [D, Hq, 1, hd]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=layer.scale, enable_gqa=True)
            out[:d] = o.squeeze(2)
        qsl = md.query_start_loc
        for i in range(d, md.num_reqs):
            s, e = int(qsl[i]), int(qsl[i + 1])
            qi = q[s:e].transpose(0, 1).unsqueeze(0)
            if md.num_computed_tokens[i] == 0 and window is None and md.span_limits(i) is None:
                ki = k[s:e].transpose(0, 1).unsqueeze(0)
                vi = v[s:e].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=layer.scale, enable_gqa=True)
            else:
                idx, mask = metadata.prefill_inputs(i, window)
                ki = read_k(idx).transpose(0, 1).unsqueeze(0)
                vi = read_v(idx).transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layer.scale, enable_gqa=True)
            out[s:e] = o[0].transpose(0, 1)
        return out
