"""Compiled CPU paged attention: decodes and chunks with cached context read K/V in place from the blocks.

Fresh prefills (nothing cached yet) use torch SDPA on the new K/V directly, which is exact and GEMM-fast.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagemill.kernels import load_kernels
from pagemill.attention.backends.torch_paged import TorchPagedAttention
from pagemill.attention.metadata import CommonAttentionMetadata


class CpuPagedAttention(TorchPagedAttention):
    """Paged attention with the C++ kernel; requests must be ordered decodes, context chunks, fresh prefills.

    The cache has the reference shape, but each K block is stored transposed ([kv_heads, head_dim, block_size])
    so the kernel scores 16 keys per vector instruction; only whole-block copies (swap, copy-on-write) touch it
    from outside.
    """

    name = "cpu"

    def __init__(self) -> None:
        self.kernel = load_kernels()
        if self.kernel is None:
            raise RuntimeError("the CPU paged-attention kernel is not available")

    @staticmethod
    def _kernel_inputs(md: CommonAttentionMetadata):
        if "kernel" not in md.extra:
            num = int(np.count_nonzero((md.num_computed_tokens > 0) | (np.diff(md.query_start_loc) == 1)))
            md.extra["kernel"] = (
                num,
                int(md.query_start_loc[num]),
                torch.from_numpy(np.ascontiguousarray(md.block_table[:num])),
                torch.from_numpy(md.query_start_loc[: num + 1].astype(np.int64)),
                torch.from_numpy(md.num_computed_tokens[:num].astype(np.int64)),
            )
        return md.extra["kernel"]

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: CommonAttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq, D]."""
        if q.dtype != torch.float32:
            return super().forward(layer, q, k, v, kv_cache, md)
        n = md.num_actual_tokens
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        slots = md.slot_mapping
        bs = k_cache.shape[1]
        k_blocks = k_cache.view(k_cache.shape[0], layer.num_kv_heads, layer.head_dim, bs)  # K stored transposed
        k_blocks[slots // bs, :, :, slots % bs] = k[:n].to(k_cache.dtype)
        v_cache.view(-1, layer.num_kv_heads, layer.head_dim).index_copy_(0, slots, v[:n].to(v_cache.dtype))
        k, v = self._as_stored(k, v, k_cache.dtype, md)
        out = torch.empty_like(q)
        self._attend(layer, q.contiguous(), k, v, k_cache, v_cache, md, out)
        return out

    def forward_fused(self, layer, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, kv_cache: torch.Tensor, md: CommonAttentionMetadata,
                      out_dtype: torch.dtype) -> torch.Tensor | None:
        """RoPE + cache write in one kernel from the QKV projection output, then attention into `out_dtype`.

        None when this layer's dtypes are not the kernel's (the caller then takes the unfused path).
        """
        if cos.dtype != torch.float32:
            return None
        t = qkv.shape[0]
        q = torch.empty(t, layer.num_heads, layer.head_dim)
        k = torch.empty(t, layer.num_kv_heads, layer.head_dim)
        v = torch.empty(t, layer.num_kv_heads, layer.head_dim)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self.kernel.rope_and_cache(q, k, v, qkv.contiguous(), positions, cos, sin, k_cache, v_cache, md.slot_mapping)
        k, v = self._as_stored(k, v, k_cache.dtype, md)
        out = torch.empty(t, layer.num_heads, layer.head_dim, dtype=out_dtype)
        self._attend(layer, q, k, v, k_cache, v_cache, md, out)
        return out

    def _as_stored(self, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype,
                   md: CommonAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v rounded as the cache stores them, so fresh prefills (SDPA on k, v) see what decodes see."""
        if cache_dtype == k.dtype or self._kernel_inputs(md)[0] == md.num_reqs:  # same dtype, or no fresh prefill
            return k, v
        return k.to(cache_dtype).to(k.dtype), v.to(cache_dtype).to(v.dtype)

    def _attend(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, md: CommonAttentionMetadata, out: torch.Tensor) -> None:
        """Attention for K/V already in the cache: the kernel for decodes and chunks, SDPA for fresh prefills."""
        num, num_tokens, block_table, qsl, ctx = self._kernel_inputs(md)
        if num:
            self.kernel.paged_attention(out[:num_tokens], q[:num_tokens], k_cache, v_cache, block_table,
                                        qsl, ctx, layer.scale, layer.sliding_window or 0)
        starts = md.query_start_loc
        for i in range(num, md.num_reqs):
            s, e = int(starts[i]), int(starts[i + 1])
            qi = q[s:e].transpose(0, 1).unsqueeze(0)
            ki = k[s:e].transpose(0, 1).unsqueeze(0)
            vi = v[s:e].transpose(0, 1).unsqueeze(0)
            if layer.sliding_window is None:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=layer.scale, enable_gqa=True)
            else:
                idx = torch.arange(e - s)
                mask = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - layer.sliding_window)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layer.scale, enable_gqa=True)
            out[s:e] = o[0].transpose(0, 1)
