"""The compiled CPU paged-attention kernel against the pure-torch reference backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagemill.attention.backends.torch_paged import TorchPagedAttention
from pagemill.attention.metadata import CommonAttentionMetadata


class _Layer:
    def __init__(self, hq: int, hk: int, d: int, window: int | None) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hk, d
        self.scale, self.sliding_window, self.qk_norm = d**-0.5, window, None


def _batch(rng: np.random.Generator, specs: list[tuple[int, int]], block_size: int, num_blocks: int, hk: int,
           d: int, hq: int):
    """Random cache + metadata for requests given as (context_len, query_len), ordered as the runner does."""
    perm = rng.permutation(np.arange(1, num_blocks))  # scattered physical blocks
    max_blocks = max(-(-(c + q) // block_size) for c, q in specs)
    table = np.zeros((len(specs), max_blocks), dtype=np.int64)
    used = 0
    for i, (c, q) in enumerate(specs):
        nb = -(-(c + q) // block_size)
        table[i, :nb] = perm[used:used + nb]
        used += nb
    counts = np.array([q for _, q in specs])
    ctx = np.array([c for c, _ in specs])
    qsl = np.concatenate([[0], np.cumsum(counts)])
    pos = np.concatenate([np.arange(c, c + q) for c, q in specs])
    req = np.repeat(np.arange(len(specs)), counts)
    slots = table[req, pos // block_size] * block_size + pos % block_size
    md = CommonAttentionMetadata(len(specs), int((counts == 1).sum()), int(qsl[-1]), qsl, ctx + counts, ctx, table,
                                 block_size, torch.from_numpy(slots))
    cache = torch.randn(2, num_blocks, block_size, hk, d)  # context K/V already "cached"
    t = int(qsl[-1])
    return md, cache, torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)


def _fused_inputs(specs: list[tuple[int, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_pos: int):
    """What forward_fused takes for a _batch: the rotary table, positions and the QKV projection output, and the
    q, k it rotates (for the reference)."""
    from transformers import LlamaConfig

    from pagemill.layers.rotary import RotaryEmbedding

    hq, d = q.shape[1], q.shape[2]
    rotary = RotaryEmbedding(LlamaConfig(hidden_size=hq * d, num_attention_heads=hq), max_pos, torch.float32)
    positions = torch.from_numpy(np.concatenate([np.arange(c, c + n) for c, n in specs]))
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_rot, k_rot = rotary(positions, q, k)
    return rotary, positions, qkv, q_rot, k_rot


def _kernel_layout(cache: torch.Tensor) -> torch.Tensor:
    """The reference cache [2, NB, BS, Hk, D] with each K block transposed to [Hk, D, BS] (the CPU kernel's)."""
    out = cache.clone()
    nb, bs, hk, d = cache.shape[1:]
    out[0].view(nb, hk, d, bs).copy_(cache[0].permute(0, 2, 3, 1))
    return out


def _reference_layout(cache: torch.Tensor) -> torch.Tensor:
    """Inverse of _kernel_layout."""
    out = cache.clone()
    nb, bs, hk, d = cache.shape[1:]
    out[0].copy_(cache[0].view(nb, hk, d, bs).permute(0, 3, 1, 2))
    return out


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("hq,hk", [(9, 3), (4, 4), (8, 1), (16, 1)])
def test_cpu_kernel_matches_torch_reference(window, block_size, hq, hk):
    from pagemill.attention.backends.cpu_paged import CpuPagedAttention

    rng = np.random.default_rng(0)
    specs = [(5, 1), (40, 1), (0, 1), (17, 6), (3, 30), (0, 25), (0, 3)]  # decodes, context chunks, fresh prefills
    md, cache, q, k, v = _batch(rng, specs, block_size, 64, hk, 32, hq)
    layer = _Layer(hq, hk, 32, window)
    torch_backend, cpu_backend = TorchPagedAttention(), CpuPagedAttention()
    ref = torch_backend.forward(layer, q, k, v, cache.clone(), torch_backend.build_metadata(md))
    cache2 = _kernel_layout(cache)
    out = cpu_backend.forward(layer, q, k, v, cache2, cpu_backend.build_metadata(md))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    ref_cache = cache.clone()
    torch_backend.forward(layer, q, k, v, ref_cache, torch_backend.build_metadata(md))
    torch.testing.assert_close(_reference_layout(cache2), ref_cache)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_cpu_kernel_reduced_precision_cache_and_output(cache_dtype, out_dtype):
    """A fp16/bf16 KV cache: the kernel path equals the torch reference on the same stored values."""
    from pagemill.attention.backends.cpu_paged import CpuPagedAttention

    rng = np.random.default_rng(1)
    torch.manual_seed(1)
    specs = [(5, 1), (40, 1), (17, 6), (0, 9)]
    hq, hk, d = 9, 3, 64
    md, cache, q, k, v = _batch(rng, specs, 16, 32, hk, d, hq)
    cache = cache.to(cache_dtype)
    layer = _Layer(hq, hk, d, None)
    rotary, positions, qkv, q_rot, k_rot = _fused_inputs(specs, q, k, v, 128)
    torch_backend, cpu_backend = TorchPagedAttention(), CpuPagedAttention()
    ref = torch_backend.forward(layer, q_rot, k_rot, v, cache.clone(), torch_backend.build_metadata(md))
    cache2 = _kernel_layout(cache)
    out = cpu_backend.forward_fused(layer, qkv, positions, rotary.cos, rotary.sin, cache2,
                                    cpu_backend.build_metadata(md), out_dtype)
    assert out.dtype == out_dtype
    # the kernel's RoPE differs from torch's in the last fp32 bit, which can flip a key's fp16/bf16 rounding
    tol = 2e-3 if out_dtype == torch.float16 else 5e-4
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    ref_cache = cache.clone()
    torch_backend.forward(layer, q_rot, k_rot, v, ref_cache, torch_backend.build_metadata(md))
    torch.testing.assert_close(_reference_layout(cache2).float(), ref_cache.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("hq,hk", [(9, 3), (4, 1), (6, 2), (5, 1)])
def test_decode_alone_equals_decode_in_a_batch_bit_for_bit(hq, hk):
    """A decode's output does not change by a bit between running alone on 2 threads (a few work items, scheduled
    differently) and running in a batch, and matches the reference. (Splitting a KV head's query heads between the
    threads when the items are few was tried and dropped: slower, and under -ffast-math not bit-stable.)"""
    from pagemill.attention.backends.cpu_paged import CpuPagedAttention

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rng = np.random.default_rng(1)
        specs = [(300, 1)] + [(int(c), 1) for c in rng.integers(1, 200, 7)]
        md, cache, q, k, v = _batch(rng, specs, 16, 256, hk, 64, hq)
        layer, backend = _Layer(hq, hk, 64, None), CpuPagedAttention()
        batched = backend.forward(layer, q, k, v, _kernel_layout(cache), backend.build_metadata(md))
        md1 = CommonAttentionMetadata(1, 1, 1, md.query_start_loc[:2], md.seq_lens[:1], md.num_computed_tokens[:1],
                                      md.block_table[:1], md.block_size, md.slot_mapping[:1])
        alone = backend.forward(layer, q[:1], k[:1], v[:1], _kernel_layout(cache), backend.build_metadata(md1))
        ref = TorchPagedAttention().forward(layer, q[:1], k[:1], v[:1], cache.clone(),
                                            TorchPagedAttention().build_metadata(md1))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, batched[:1])
    torch.testing.assert_close(alone, ref, atol=2e-5, rtol=1e-4)
