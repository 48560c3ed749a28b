"""Compiled CPU paged attention: decodes and chunks with cached context read K/V in place from the blocks.

Fresh prefills (nothing cached yet) use torch SDPA on the new K/V directly, which is exact and GEMM-fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagemill.attention.backend import FLOAT_AND_QUANT_KV_DTYPES, AttentionCapabilities
from pagemill.attention.kv_quant import (group_size, is_quantized, num_scales, pack_rows, quantize, row_width,
                                         scale_dtype, unpack_rows)
from pagemill.attention.backends.torch_paged import TorchAttentionMetadata, TorchPagedAttention
from pagemill.attention.metadata import CommonAttentionMetadata
from pagemill.kernels import load_kernels


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    """The kernel's inputs: its requests (decodes and context chunks, first in the batch) and their tokens."""

    num_kernel_reqs: int = 0
    num_kernel_tokens: int = 0
    block_table: torch.Tensor | None = None  # [num_kernel_reqs, max_blocks]
    query_start_loc: torch.Tensor | None = None  # [num_kernel_reqs + 1]
    context_lens: torch.Tensor | None = None  # [num_kernel_reqs] tokens cached before the step
    _span_reqs: list[int] | None = None

    def span_reqs(self) -> list[int]:
        """The requests with a new token that sees past its own position (an image token that sees its whole
        image): attended from the cache in torch after the kernel, over its causal result."""
        if self._span_reqs is None:
            md = self.common
            self._span_reqs = ([] if md.key_limits is None else
                               [i for i in range(md.num_reqs) if md.span_limits(i) is not None])
        return self._span_reqs


class CpuPagedAttention(TorchPagedAttention):
    """Paged attention with the C++ kernel; requests must be ordered decodes, context chunks, fresh prefills.

    The cache has the reference shape, but each K block is stored transposed ([kv_heads, head_dim, block_size])
    so the kernel scores 16 keys per vector instruction; only whole-block copies (swap, copy-on-write) touch it
    from outside. A float16 / bfloat16 model (queries not in float32) takes the reference path throughout, with
    the reference layout. A quantized cache (attention/kv_quant.py) stores each K block as [kv_heads, head_dim,
    block_size] codes followed by [kv_heads, scales per row, block_size] scales (int8: one float16 per 16 channels;
    fp8: one float32 per row) and each V row as codes + scales; the kernel widens the codes in registers. The
    fused RoPE kernel writes the quantized rows itself (csrc/cpu/kv_rows.cpp: torch's arithmetic, the same bytes);
    the unfused `forward` quantizes in torch.
    """

    name = "cpu"
    capabilities = AttentionCapabilities(fused_rope_cache_write=True, fused_dtypes=(torch.float32,),
                                         qk_norm_hook=True, kv_cache_dtypes=FLOAT_AND_QUANT_KV_DTYPES,
                                         key_limits=True)
    batch_order = (0, 1, 2)  # decodes, context chunks, fresh prefills

    def __init__(self) -> None:
        self.kernel = load_kernels()
        if self.kernel is None:
            raise RuntimeError("the CPU paged-attention kernel is not available")

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        """The kernel takes every request with cached context or a single new token (they come first)."""
        qsl, ctx = common.query_start_loc, common.num_computed_tokens
        num = int(np.count_nonzero((ctx > 0) | (np.diff(qsl) == 1)))
        return CpuAttentionMetadata(
            common, num_kernel_reqs=num, num_kernel_tokens=int(qsl[num]),
            block_table=torch.from_numpy(np.ascontiguousarray(common.block_table[:num])),
            query_start_loc=torch.from_numpy(qsl[: num + 1].astype(np.int64)),
            context_lens=torch.from_numpy(ctx[:num].astype(np.int64)))

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: CpuAttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq, D]."""
        if q.dtype != torch.float32:
            return super().forward(layer, q, k, v, kv_cache, metadata)
        md = metadata.common
        n = md.num_actual_tokens
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        slots = md.slot_mapping
        if is_quantized(kv_cache.dtype):
            k, v = self._write_quantized(layer, k, v, k_cache, v_cache, md.slot_mapping)
            out = torch.empty_like(q)
            self._attend(layer, q.contiguous(), k, v, k_cache, v_cache, metadata, out)
            return out
        bs = k_cache.shape[1]
        k_blocks = k_cache.view(k_cache.shape[0], layer.num_kv_heads, layer.head_dim, bs)  # K stored transposed
        k_blocks[slots // bs, :, :, slots % bs] = k[:n].to(k_cache.dtype)
        v_cache.view(-1, layer.num_kv_heads, layer.head_dim).index_copy_(0, slots, v[:n].to(v_cache.dtype))
        k, v = self._as_stored(k, v, k_cache.dtype, metadata)
        out = torch.empty_like(q)
        self._attend(layer, q.contiguous(), k, v, k_cache, v_cache, metadata, out)
        return out

    def forward_fused(self, layer, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, kv_cache: torch.Tensor, metadata: CpuAttentionMetadata,
                      out_dtype: torch.dtype) -> torch.Tensor:
        """RoPE + cache write in one kernel from the QKV projection output, then attention into `out_dtype`."""
        t = qkv.shape[0]
        q = torch.empty(t, layer.num_heads, layer.head_dim)
        k = torch.empty(t, layer.num_kv_heads, layer.head_dim)
        v = torch.empty(t, layer.num_kv_heads, layer.head_dim)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        norms = {}
        if layer.qk_norm is not None:
            q_norm, k_norm = layer.qk_norm
            norms = dict(q_norm=q_norm.weight, k_norm=k_norm.weight, norm_eps=q_norm.eps)
        self.kernel.rope_and_cache(q, k, v, qkv.contiguous(), positions, cos, sin, k_cache, v_cache,
                                   metadata.common.slot_mapping, **norms)
        if not is_quantized(kv_cache.dtype):  # (a quantized write leaves k, v as stored itself)
            k, v = self._as_stored(k, v, k_cache.dtype, metadata)
        out = torch.empty(t, layer.num_heads, layer.head_dim, dtype=out_dtype)
        self._attend(layer, q, k, v, k_cache, v_cache, metadata, out)
        return out

    @staticmethod
    def _write_quantized(layer, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize the step's k, v [T, Hk, D] into the kernel's quantized layout at `slots`; returns k, v as stored
        (what fresh prefills attend to)."""
        n, dtype = slots.shape[0], k_cache.dtype
        nb, bs = k_cache.shape[0], k_cache.shape[1]
        hk, hd = layer.num_kv_heads, layer.head_dim
        blocks = k_cache.view(torch.uint8).view(nb, -1)
        k_codes = blocks[:, : hk * hd * bs].view(nb, hk, hd, bs)
        k_scales = blocks[:, hk * hd * bs :].view(scale_dtype(dtype)).view(nb, hk, num_scales(hd, dtype), bs)
        codes, scale = quantize(k[:n], dtype)  # [n, hk, hd], [n, hk, scales per row]
        blk, off = slots // bs, slots % bs
        k_codes[blk, :, :, off] = codes
        k_scales[blk, :, :, off] = scale
        v_rows = pack_rows(v[:n], dtype)
        v_cache.view(torch.uint8).view(-1, hk, row_width(hd, dtype)).index_copy_(0, slots, v_rows)
        k, v = k.clone(), v.clone()
        k[:n] = unpack_rows(torch.cat([codes, scale.view(torch.uint8)], dim=-1), dtype, k.dtype)
        v[:n] = unpack_rows(v_rows, dtype, v.dtype)
        return k, v

    @staticmethod
    def _as_stored(k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype,
                   metadata: CpuAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v rounded as the cache stores them, so fresh prefills (SDPA on k, v) see what decodes see."""
        if cache_dtype == k.dtype or metadata.num_kernel_reqs == metadata.common.num_reqs:  # no fresh prefill
            return k, v
        return k.to(cache_dtype).to(k.dtype), v.to(cache_dtype).to(v.dtype)

    def _attend(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: CpuAttentionMetadata, out: torch.Tensor) -> None:
        """Attention for K/V already in the cache: the kernel for decodes and chunks, SDPA for fresh prefills."""
        num, num_tokens = metadata.num_kernel_reqs, metadata.num_kernel_tokens
        if num:
            self.kernel.paged_attention(out[:num_tokens], q[:num_tokens], k_cache, v_cache, metadata.block_table,
                                        metadata.query_start_loc, metadata.context_lens, layer.scale,
                                        layer.sliding_window or 0)
        md = metadata.common
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
        for i in metadata.span_reqs():
            self._attend_span(layer, q, k_cache, v_cache, md, i, out)

    @staticmethod
    def _attend_span(layer, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     md: CommonAttentionMetadata, i: int, out: torch.Tensor) -> None:
        """Request i's attention under its key limits, over the K/V its blocks hold (K blocks stored transposed,
        [kv_heads, head_dim, block_size]; the step's K/V already written)."""
        s, e = int(md.query_start_loc[i]), int(md.query_start_loc[i + 1])
        seq, nb, bs = int(md.seq_lens[i]), k_cache.shape[0], k_cache.shape[1]
        hk, hd, dtype = layer.num_kv_heads, layer.head_dim, k_cache.dtype
        nblk = -(-seq // bs)
        blocks = torch.from_numpy(md.block_table[i, :nblk].astype(np.int64))
        if is_quantized(dtype):  # (the layouts _write_quantized writes)
            raw = k_cache.view(torch.uint8).view(nb, -1)[blocks]
            codes = raw[:, : hk * hd * bs].contiguous().view(dtype).view(nblk, hk, hd, bs)
            scales = raw[:, hk * hd * bs :].contiguous().view(scale_dtype(dtype)).view(nblk, hk, -1, bs).float()
            kb = codes.float() * scales.repeat_interleave(group_size(hd, dtype), dim=2)[:, :, :hd]
            slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)
            v_rows = v_cache.view(torch.uint8).view(-1, hk, row_width(hd, dtype))[slots]
            vi = unpack_rows(v_rows, dtype, q.dtype).transpose(0, 1)
        else:
            kb = k_cache.view(nb, hk, hd, bs)[blocks]
            vi = v_cache.view(nb, bs, hk, hd)[blocks].reshape(nblk * bs, hk, hd).transpose(0, 1)
        ki = kb.permute(1, 0, 3, 2).reshape(hk, nblk * bs, hd)
        limits = md.span_limits(i)
        kpos = np.arange(seq)[None, :]
        allowed = kpos < limits[:, None]
        if layer.sliding_window is not None:
            qpos = int(md.num_computed_tokens[i]) + np.arange(e - s)
            allowed &= kpos > qpos[:, None] - layer.sliding_window
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1).unsqueeze(0), ki[:, :seq].to(q.dtype).unsqueeze(0),
                                           vi[:, :seq].to(q.dtype).unsqueeze(0), attn_mask=torch.from_numpy(allowed),
                                           scale=layer.scale, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1).to(out.dtype)
