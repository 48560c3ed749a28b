"""Paged attention in Triton: one kernel for decode, chunked prefill and prefill over block tables, and the KV write.

Every query token is one program per KV head: it holds the token's GQA group of query heads, walks the keys of its
request from the start of its window (or 0) to its own position a block at a time with an online softmax, and
writes the group's outputs. Causality, sliding windows and any mix of decodes, prefill chunks and fresh prefills in
one step come from each token's (request, position) alone, so the step needs no batch order. The torch reference
backend (torch_paged.py) is the oracle. On the CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`,
set before this module is imported: tests and `device="cpu"`), on a GPU compiled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend is then unavailable: the selector falls back, or says why
    triton = tl = None


if triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
    from pagemill.utils.triton_interpreter import patch_interpreter_scalars

    patch_interpreter_scalars()

from pagemill.attention.backend import AttentionBackend, AttentionCapabilities
from pagemill.attention.metadata import CommonAttentionMetadata

if triton is not None:
    from pagemill.kernels.triton_common import cast_rne

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                         BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
        """Token t's K and V of KV head h into their slot of the paged cache (cast to the cache's dtype)."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        d = tl.arange(0, D_PAD)
        dmask = d < HEAD_DIM
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dmask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dmask)
        tl.store(k_cache_ptr + dst, cast_rne(k.to(tl.float32), k_cache_ptr.dtype.element_ty), mask=dmask)
        tl.store(v_cache_ptr + dst, cast_rne(v.to(tl.float32), v_cache_ptr.dtype.element_ty), mask=dmask)

    @triton.jit
    def _paged_attention_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, token_req_ptr,
                                token_pos_ptr, scale, window,
                                stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
                                stride_bt,
                                GQA: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                                D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
        """Attention of query token t's heads of KV head kh over keys [lo, pos] of its request (online softmax)."""
        t = tl.program_id(0)
        kh = tl.program_id(1)
        req = tl.load(token_req_ptr + t).to(tl.int64)
        pos = tl.load(token_pos_ptr + t)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        n = tl.arange(0, BLOCK_SIZE)
        gmask = g < GQA
        dmask = d < HEAD_DIM
        heads = kh * GQA + g
        qmask = gmask[:, None] & dmask[None, :]
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
        q = q.to(tl.float32)
        lo = pos * 0
        if window > 0:
            lo = tl.maximum(pos - window + 1, 0)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for j in range(lo // BLOCK_SIZE, pos // BLOCK_SIZE + 1):
            block = tl.load(block_table_ptr + req * stride_bt + j).to(tl.int64)
            kpos = j * BLOCK_SIZE + n
            keep = (kpos <= pos) & (kpos >= lo)
            offsets = block * stride_cb + n[:, None] * stride_cs + kh * stride_ch + d[None, :]
            k = tl.load(k_cache_ptr + offsets, mask=dmask[None, :], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(keep[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the first block holds key `lo` for every row
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + offsets, mask=dmask[None, :], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 cast_rne(out, out_ptr.dtype.element_ty), mask=qmask)

    @triton.jit
    def _paged_attention_split_kernel(acc_ptr, ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr,
                                      token_req_ptr, token_pos_ptr, scale, window,
                                      stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
                                      NUM_SPLITS: tl.constexpr, HQ: tl.constexpr,
                                      GQA: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                                      D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
        """Split-KV (flash-decoding): split s of query token t's key blocks [lo, pos], its unnormalised output and
        (max, sum) in float32 for _split_reduce_kernel. An empty split leaves (-inf, 0) and zeros."""
        t = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        req = tl.load(token_req_ptr + t).to(tl.int64)
        pos = tl.load(token_pos_ptr + t)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        n = tl.arange(0, BLOCK_SIZE)
        gmask = g < GQA
        dmask = d < HEAD_DIM
        heads = kh * GQA + g
        qmask = gmask[:, None] & dmask[None, :]
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
        q = q.to(tl.float32)
        lo = pos * 0
        if window > 0:
            lo = tl.maximum(pos - window + 1, 0)
        first = lo // BLOCK_SIZE
        nblocks = pos // BLOCK_SIZE + 1 - first
        per = (nblocks + NUM_SPLITS - 1) // NUM_SPLITS
        start = first + sp * per
        stop = tl.minimum(start + per, pos // BLOCK_SIZE + 1)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for j in range(start, stop):
            block = tl.load(block_table_ptr + req * stride_bt + j).to(tl.int64)
            kpos = j * BLOCK_SIZE + n
            keep = (kpos <= pos) & (kpos >= lo)
            offsets = block * stride_cb + n[:, None] * stride_cs + kh * stride_ch + d[None, :]
            k = tl.load(k_cache_ptr + offsets, mask=dmask[None, :], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(keep[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block of a split holds a key in [lo, pos]
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + offsets, mask=dmask[None, :], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
        row = (t * HQ + heads) * NUM_SPLITS + sp  # [G_PAD] rows of [T * HQ * NUM_SPLITS]
        tl.store(acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=qmask)
        tl.store(ml_ptr + row * 2, m_i, mask=gmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=gmask)

    @triton.jit
    def _split_reduce_kernel(out_ptr, acc_ptr, ml_ptr, stride_ot, stride_oh, NUM_SPLITS: tl.constexpr,
                             HQ: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
        """Head h of token t: the splits' partial softmaxes combined (rescaled to their common max)."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, D_PAD)
        dmask = d < HEAD_DIM
        rows = (t * HQ + h) * NUM_SPLITS + sp
        m = tl.load(ml_ptr + rows * 2)
        l_s = tl.load(ml_ptr + rows * 2 + 1)
        m_max = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
        acc = tl.load(acc_ptr + rows[:, None] * D_PAD + d[None, :], mask=dmask[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d, cast_rne(out, out_ptr.dtype.element_ty), mask=dmask)


def _pad(n: int, least: int = 16) -> int:
    """The power of two >= n and >= least (tl.dot's smallest tile side)."""
    return max(least, 1 << (n - 1).bit_length())


@dataclass
class TritonAttentionMetadata:
    """The common metadata plus each token's request and position, as device tensors (made once per device)."""

    common: CommonAttentionMetadata
    _tensors: dict = field(default_factory=dict)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block table int32 [B, max_blocks], token's request int32 [T], token's position int32 [T]) on `device`."""
        if self.common.device_tensors is not None:  # the GPU runner's persistent buffers (CUDA-graph safe)
            return self.common.device_tensors
        key = torch.device(device).type  # (cuda and cuda:0 are one device here: one GPU per rank)
        if key not in self._tensors:
            md = self.common
            qsl = md.query_start_loc
            counts = np.diff(qsl[:md.num_reqs + 1])
            token_req = np.repeat(np.arange(md.num_reqs), counts)
            token_pos = md.num_computed_tokens[token_req] + np.arange(int(qsl[md.num_reqs])) - qsl[token_req]
            self._tensors[key] = tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)
                                          for a in (md.block_table, token_req, token_pos))
        return self._tensors[key]


class TritonPagedAttention(AttentionBackend):
    """Triton paged attention (the CUDA platform's backend; the interpreter runs it on the CPU)."""

    name = "triton"
    capabilities = AttentionCapabilities()
    batch_order = (0, 1, 1)  # any order works; decodes first like the others

    # split-KV decoding: a step of few (token, KV head) programs splits each token's keys over up to this many
    # programs (flash-decoding), so a small decode batch over long contexts still fills the GPU
    max_kv_splits = 16
    target_programs = 256  # (token x KV head x split) programs a step aims for: a few per SM

    def __init__(self, num_kv_splits: int | None = None) -> None:
        if triton is None:
            raise RuntimeError("attention_backend='triton' needs the triton package (pip install triton)")
        if num_kv_splits is not None and (num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1)):
            raise ValueError(f"num_kv_splits must be a power of two, got {num_kv_splits}")
        self.num_kv_splits = num_kv_splits  # None: choose per step (kv_splits)

    def kv_splits(self, num_tokens: int, num_kv_heads: int, device: torch.device | None = None) -> int:
        """Splits per token's keys: 1 for a big step, up to max_kv_splits (a power of two) for a small one. It
        depends on the step's shape only, never on its lengths, so a CUDA graph captured for a decode bucket keeps
        it (a short context simply leaves some splits empty)."""
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        if device is not None and device.type == "cpu":  # the interpreter: more programs only cost time
            return 1
        want = self.target_programs // max(1, num_tokens * num_kv_heads)
        return 1 if want < 2 else min(self.max_kv_splits, 1 << (want.bit_length() - 1))

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """[2 (K/V), num_blocks, block_size, kv_heads, head_dim], as the torch reference's."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """Token tables are made on first use, on the device of the step's tensors."""
        return TritonAttentionMetadata(common)

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TritonAttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq, D]: the step's K/V written by slot, then attention."""
        md = metadata.common
        n = md.num_actual_tokens
        out = torch.empty_like(q)
        if n == 0:
            return out
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        block_size = k_cache.shape[1]
        block_table, token_req, token_pos = metadata.tensors(q.device)
        d_pad = _pad(head_dim)
        _write_kv_kernel[(n, num_kv_heads)](
            k, v, k_cache, v_cache, md.slot_mapping.to(q.device),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=d_pad)
        gqa = q.shape[1] // num_kv_heads
        splits = self.kv_splits(n, num_kv_heads, q.device)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        if splits > 1:
            hq = q.shape[1]
            acc = torch.empty(n * hq * splits, d_pad, dtype=torch.float32, device=q.device)
            ml = torch.empty(n * hq * splits, 2, dtype=torch.float32, device=q.device)
            _paged_attention_split_kernel[(n, num_kv_heads, splits)](
                acc, ml, q, k_cache, v_cache, block_table, token_req, token_pos, float(layer.scale),
                int(layer.sliding_window or 0), q.stride(0), q.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
                NUM_SPLITS=splits, HQ=hq, GQA=gqa, G_PAD=_pad(gqa), HEAD_DIM=head_dim, D_PAD=d_pad,
                BLOCK_SIZE=_pad(block_size, 1), PRECISION=precision)
            _split_reduce_kernel[(n, hq)](out, acc, ml, out.stride(0), out.stride(1), NUM_SPLITS=splits, HQ=hq,
                                          HEAD_DIM=head_dim, D_PAD=d_pad)
            return out
        _paged_attention_kernel[(n, num_kv_heads)](
            out, q, k_cache, v_cache, block_table, token_req, token_pos, float(layer.scale),
            int(layer.sliding_window or 0),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
            GQA=gqa, G_PAD=_pad(gqa), HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=_pad(block_size, 1),
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
        return out
