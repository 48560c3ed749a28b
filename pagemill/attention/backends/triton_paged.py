"""Paged attention in Triton: one kernel for decode, chunked prefill and prefill over block tables, and the KV write.

One program per query tile and KV head: a tile is one token in a decode batch, or a run of consecutive tokens of one
request when the step has prefill tokens (so they share every key load); its rows are the tokens' GQA groups of
query heads. It walks the request's keys from the start of the window (or 0) to the last row's position, TILE_N keys
at a time gathered across pages, with an online softmax; each row masks by its own position (causality, sliding
window). Any mix of decodes, prefill chunks and fresh prefills in one step comes from each token's (request,
position) alone, so the step needs no batch order. A small decode batch over long contexts splits each tile's keys
over several programs (flash-decoding) and reduces them after. Half-precision models multiply in their dtype with
float32 accumulation (as FlashAttention); float32 ones in IEEE float32. The torch reference
backend (torch_paged.py) is the oracle. On the CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`,
set before this module is imported: tests and `device="cpu"`), on a GPU compiled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property

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
from pagemill.utils.torch_utils import host_to_device

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
    def _unified_attention_kernel(out_ptr, acc_ptr, ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr,
                                  token_req_ptr, token_pos_ptr, tile_first_ptr, tile_count_ptr, scale, window,
                                  stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
                                  stride_bt,
                                  SINGLE_TOKEN: tl.constexpr, NUM_SPLITS: tl.constexpr, HQ: tl.constexpr,
                                  GQA: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                  TILE_N: tl.constexpr, PRECISION: tl.constexpr):
        """Attention of a query tile (up to BLOCK_M // G_PAD consecutive tokens of one request, each with its GQA
        group of query heads of KV head kh) over its keys, TILE_N keys (gathered across pages) at a time with an
        online softmax. Split s of NUM_SPLITS > 1 (flash-decoding) covers a share of the key tiles and leaves its
        unnormalised output and (max, sum) in float32 for _split_reduce_kernel."""
        tile = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        if SINGLE_TOKEN:  # every request has one query token: tile = token
            first = tile
            count = 1
        else:
            first = tl.load(tile_first_ptr + tile)
            count = tl.load(tile_count_ptr + tile)
        req = tl.load(token_req_ptr + first).to(tl.int64)
        pos0 = tl.load(token_pos_ptr + first)
        r = tl.arange(0, BLOCK_M)
        qi = r // G_PAD
        g = r % G_PAD
        d = tl.arange(0, D_PAD)
        dmask = d < HEAD_DIM
        rmask = (qi < count) & (g < GQA)
        tok = (first + qi).to(tl.int64)
        pos_r = pos0 + qi  # each row's own position (causality)
        heads = kh * GQA + g
        qmask = rmask[:, None] & dmask[None, :]
        q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qmask,
                    other=0.0)
        if PRECISION == "ieee":
            q = q.to(tl.float32)
        lo_r = pos_r * 0
        if window > 0:
            lo_r = tl.maximum(pos_r - window + 1, 0)
        pos_max = pos0 + count - 1
        lo = pos0 * 0
        if window > 0:
            lo = tl.maximum(pos0 - window + 1, 0)  # the tile's first row starts earliest
        first_tile = lo // TILE_N
        ntiles = pos_max // TILE_N + 1 - first_tile
        per = (ntiles + NUM_SPLITS - 1) // NUM_SPLITS
        start = first_tile + sp * per
        stop = tl.minimum(start + per, pos_max // TILE_N + 1)
        n = tl.arange(0, TILE_N)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for j in range(start, stop):
            kpos = j * TILE_N + n
            kin = kpos <= pos_max
            block = tl.load(block_table_ptr + req * stride_bt + kpos // BLOCK_SIZE, mask=kin, other=0).to(tl.int64)
            offsets = block[:, None] * stride_cb + (kpos % BLOCK_SIZE)[:, None] * stride_cs + kh * stride_ch \
                + d[None, :]
            kvmask = kin[:, None] & dmask[None, :]
            k = tl.load(k_cache_ptr + offsets, mask=kvmask, other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            keep = (kpos[None, :] <= pos_r[:, None]) & (kpos[None, :] >= lo_r[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to rescale
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + offsets, mask=kvmask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # (l_i is 0 only on padding rows, not stored)
            tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     cast_rne(out, out_ptr.dtype.element_ty), mask=qmask)
        else:
            row = (tok * HQ + heads) * NUM_SPLITS + sp  # [BLOCK_M] rows of [T * HQ * NUM_SPLITS]
            tl.store(acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=qmask)
            tl.store(ml_ptr + row * 2, m_i, mask=rmask)
            tl.store(ml_ptr + row * 2 + 1, l_i, mask=rmask)

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


def query_tiles(query_start_loc: np.ndarray, num_reqs: int, tokens_per_tile: int) -> tuple[np.ndarray, np.ndarray]:
    """(first token, token count) of each query tile: every request's tokens cut into runs of `tokens_per_tile`
    consecutive tokens (a tile never spans two requests)."""
    lens = np.diff(query_start_loc[:num_reqs + 1]).astype(np.int64)
    per_req = -(-lens // tokens_per_tile)
    req = np.repeat(np.arange(num_reqs), per_req)
    k = np.arange(int(per_req.sum())) - np.repeat(np.cumsum(per_req) - per_req, per_req)
    first = query_start_loc[req] + k * tokens_per_tile
    return first.astype(np.int32), np.minimum(tokens_per_tile, lens[req] - k * tokens_per_tile).astype(np.int32)


@dataclass
class TritonAttentionMetadata:
    """The common metadata plus each token's request and position, and the step's query tiles, as device tensors
    (made once per device and step, shared by the layers)."""

    common: CommonAttentionMetadata
    _tensors: dict = field(default_factory=dict)

    @cached_property
    def single_token(self) -> bool:
        """Whether every request has one query token this step (a decode batch: tile = token, no tile table)."""
        md = self.common
        return int(md.query_start_loc[md.num_reqs]) == md.num_reqs

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
            arrays = (np.ascontiguousarray(a, dtype=np.int32) for a in (md.block_table, token_req, token_pos))
            self._tensors[key] = tuple(host_to_device(torch.from_numpy(a), device) for a in arrays)
        return self._tensors[key]

    def tiles(self, device: torch.device, tokens_per_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(first token int32 [tiles], token count int32 [tiles]) of the step's query tiles on `device`."""
        key = (torch.device(device).type, tokens_per_tile)
        if key not in self._tensors:
            md = self.common
            self._tensors[key] = tuple(host_to_device(torch.from_numpy(a), device)
                                       for a in query_tiles(md.query_start_loc, md.num_reqs, tokens_per_tile))
        return self._tensors[key]


class TritonPagedAttention(AttentionBackend):
    """Triton paged attention (the CUDA platform's backend; the interpreter runs it on the CPU)."""

    name = "triton"
    capabilities = AttentionCapabilities()
    batch_order = (0, 1, 1)  # any order works; decodes first like the others

    # split-KV decoding: a step of few (token, KV head) programs splits each token's keys over up to this many
    # programs (flash-decoding), so a small decode batch over long contexts still fills the GPU
    max_kv_splits = 16
    target_programs = 256  # (query tile x KV head x split) programs a step aims for: a few per SM
    key_tile = 64  # keys per inner iteration, gathered across pages (half that for head dims over 128; float32 half)
    prefill_rows = 64  # query rows (tokens x GQA group) per program in a step with prefill tokens (half precision)

    def __init__(self, num_kv_splits: int | None = None) -> None:
        if triton is None:
            raise RuntimeError("attention_backend='triton' needs the triton package (pip install triton)")
        if num_kv_splits is not None and (num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1)):
            raise ValueError(f"num_kv_splits must be a power of two, got {num_kv_splits}")
        self.num_kv_splits = num_kv_splits  # None: choose per step (kv_splits)

    def kv_splits(self, num_tokens: int, num_kv_heads: int, device: torch.device | None = None) -> int:
        """Splits per query tile's keys (`num_tokens`: the step's tiles): 1 for a big step, up to max_kv_splits (a
        power of two) for a small one. It depends on the step's shape only, never on its lengths, so a CUDA graph
        captured for a decode bucket keeps it (a short context simply leaves some splits empty)."""
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        if device is not None and device.type == "cpu":  # the interpreter: more programs only cost time
            return 1
        want = self.target_programs // max(1, num_tokens * num_kv_heads)
        return 1 if want < 2 else min(self.max_kv_splits, 1 << (want.bit_length() - 1))

    @staticmethod
    def _precision(q: torch.Tensor) -> str:
        """"ieee": products in float32 (float32 models; bf16 under the interpreter, whose bf16 dot is wrong);
        else the model's half dtype (the string is then only a flag)."""
        if q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type == "cpu"):
            return "ieee"
        return "tf32"

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
        hq = q.shape[1]
        g_pad = _pad(gqa, 1)
        precision = self._precision(q)
        # float32 (exactness checks, not speed): smaller tiles, which compile several times faster
        half = precision != "ieee"
        if metadata.single_token:  # decodes (and a CUDA graph's padded batch): one token per program
            tiles, block_m = n, max(16, g_pad)
            tile_first = tile_count = token_req  # (unused)
        else:  # prefill tokens: query tiles of consecutive tokens share each key tile's load
            block_m = max(16, g_pad, self.prefill_rows if half else 16)
            tile_first, tile_count = metadata.tiles(q.device, block_m // g_pad)
            tiles = tile_first.shape[0]
        splits = self.kv_splits(tiles, num_kv_heads, q.device)
        tile_n = (self.key_tile if half else self.key_tile // 2) // (1 if head_dim <= 128 else 2)
        if splits > 1:
            acc = torch.empty(n * hq * splits, d_pad, dtype=torch.float32, device=q.device)
            ml = torch.empty(n * hq * splits, 2, dtype=torch.float32, device=q.device)
        else:
            acc = ml = out  # (unused)
        _unified_attention_kernel[(tiles, num_kv_heads, splits)](
            out, acc, ml, q, k_cache, v_cache, block_table, token_req, token_pos, tile_first, tile_count,
            float(layer.scale), int(layer.sliding_window or 0),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
            SINGLE_TOKEN=metadata.single_token, NUM_SPLITS=splits, HQ=hq, GQA=gqa, G_PAD=g_pad, BLOCK_M=block_m,
            HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, TILE_N=tile_n,
            PRECISION=precision)
        if splits > 1:
            _split_reduce_kernel[(n, hq)](out, acc, ml, out.stride(0), out.stride(1), NUM_SPLITS=splits, HQ=hq,
                                          HEAD_DIM=head_dim, D_PAD=d_pad)
        return out
