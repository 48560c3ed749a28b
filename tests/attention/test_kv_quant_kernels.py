"""The quantized KV cache (int8 / fp8 e4m3 / fp8 e5m2): the compiled kernel against the torch reference, per ISA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagemill.attention.backends.torch_paged import TorchPagedAttention
from pagemill.attention.kv_quant import pack_rows, unpack_rows
from tests.attention.test_backends import _batch, _Layer

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def _quantized_cache(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float reference cache [2, NB, BS, Hk, D] as the torch reference's quantized cache [2, NB, BS, Hk, D + 4]."""
    return pack_rows(cache, dtype).view(dtype)


def _kernel_layout(qcache: torch.Tensor) -> torch.Tensor:
    """The reference quantized cache with each K block as [Hk, D, BS] codes then [Hk, BS] scales (the kernel's)."""
    out = qcache.clone()
    nb, bs, hk, w = qcache.shape[1:]
    d = w - 4
    src = qcache[0].view(torch.uint8)
    blocks = out[0].view(torch.uint8).view(nb, -1)
    blocks[:, : hk * d * bs].view(nb, hk, d, bs).copy_(src[..., :d].permute(0, 2, 3, 1))
    blocks[:, hk * d * bs :].view(nb, hk, bs, 4).copy_(src[..., d:].permute(0, 2, 1, 3))
    return out


def _reference_layout(kcache: torch.Tensor) -> torch.Tensor:
    """Inverse of _kernel_layout."""
    out = kcache.clone()
    nb, bs, hk, w = kcache.shape[1:]
    d = w - 4
    blocks = kcache[0].view(torch.uint8).view(nb, -1)
    dst = out[0].view(torch.uint8)
    dst[..., :d].copy_(blocks[:, : hk * d * bs].view(nb, hk, d, bs).permute(0, 3, 1, 2))
    dst[..., d:].copy_(blocks[:, hk * d * bs :].view(nb, hk, bs, 4).permute(0, 2, 1, 3))
    return out


def test_layout_helpers_round_trip():
    """The test's own layout conversion is a bijection (so the cache comparisons below mean something)."""
    cache = _quantized_cache(torch.randn(2, 5, 4, 3, 8), torch.int8)
    k = _kernel_layout(cache)
    assert not torch.equal(k.view(torch.uint8), cache.view(torch.uint8))
    assert torch.equal(_reference_layout(k).view(torch.uint8), cache.view(torch.uint8))


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("hq,hk", [(9, 3), (8, 1), (4, 4)])
def test_quantized_kernel_matches_torch_reference(dtype, window, block_size, hq, hk):
    """Decodes, context chunks and fresh prefills: same output as the reference and the same cache bytes."""
    from pagemill.attention.backends.cpu_paged import CpuPagedAttention

    rng = np.random.default_rng(0)
    specs = [(5, 1), (40, 1), (0, 1), (17, 6), (3, 30), (0, 25), (0, 3)]
    md, cache, q, k, v = _batch(rng, specs, block_size, 64, hk, 32, hq)
    qcache = _quantized_cache(cache, dtype)
    layer = _Layer(hq, hk, 32, window)
    torch_backend, cpu_backend = TorchPagedAttention(), CpuPagedAttention()
    ref_cache = qcache.clone()
    ref = torch_backend.forward(layer, q, k, v, ref_cache, torch_backend.build_metadata(md))
    kcache = _kernel_layout(qcache)
    out = cpu_backend.forward(layer, q, k, v, kcache, cpu_backend.build_metadata(md))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(_reference_layout(kcache).view(torch.uint8), ref_cache.view(torch.uint8))
    # and the quantized result is close to attention over the float cache
    float_ref = torch_backend.forward(layer, q, k, v, cache.clone(), torch_backend.build_metadata(md))
    err = (out - float_ref).abs().max().item()
    assert err < {torch.int8: 0.05, torch.float8_e4m3fn: 0.2, torch.float8_e5m2: 0.4}[dtype]


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_quantized_fused_rope_path(dtype, out_dtype):
    """forward_fused (RoPE in the kernel, quantize on write) equals the reference on the rotated q, k."""
    from transformers import LlamaConfig

    from pagemill.attention.backends.cpu_paged import CpuPagedAttention
    from pagemill.layers.rotary import RotaryEmbedding

    rng = np.random.default_rng(1)
    specs = [(5, 1), (40, 1), (17, 6), (0, 9)]
    hq, hk, d = 9, 3, 64
    md, cache, q, k, v = _batch(rng, specs, 16, 32, hk, d, hq)
    qcache = _quantized_cache(cache, dtype)
    layer = _Layer(hq, hk, d, None)
    rotary = RotaryEmbedding(LlamaConfig(hidden_size=hq * d, num_attention_heads=hq), 128, torch.float32)
    positions = torch.from_numpy(np.concatenate([np.arange(c, c + n) for c, n in specs]))
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_rot, k_rot = rotary(positions, q, k)
    torch_backend, cpu_backend = TorchPagedAttention(), CpuPagedAttention()
    ref = torch_backend.forward(layer, q_rot, k_rot, v, qcache.clone(), torch_backend.build_metadata(md))
    kcache = _kernel_layout(qcache)
    out = cpu_backend.forward_fused(layer, qkv, positions, rotary.cos, rotary.sin, kcache,
                                    cpu_backend.build_metadata(md), out_dtype)
    assert out.dtype == out_dtype
    # the kernel's RoPE differs from torch's in the last fp32 bit, which can move a key to the next code
    tol = 2e-2 if out_dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    ref_cache = qcache.clone()
    torch_backend.forward(layer, q_rot, k_rot, v, ref_cache, torch_backend.build_metadata(md))
    back = _reference_layout(kcache).view(torch.uint8)
    assert torch.equal(back[1], ref_cache.view(torch.uint8)[1])  # V is not rotated: identical bytes
    stored = unpack_rows(back[0], dtype, torch.float32)
    torch.testing.assert_close(stored, unpack_rows(ref_cache.view(torch.uint8)[0], dtype, torch.float32),
                               atol=0.1, rtol=0.1)


def test_int8_rows_quantize_per_token_and_head():
    """Each row gets its own scale: a large row does not crush a small one, and zero rows stay zero."""
    x = torch.zeros(3, 2, 16)
    x[0, 0] = torch.linspace(-100, 100, 16)
    x[0, 1] = torch.linspace(-1e-3, 1e-3, 16)
    rows = pack_rows(x, torch.int8)
    back = unpack_rows(rows, torch.int8, torch.float32)
    torch.testing.assert_close(back[0, 1], x[0, 1], atol=1e-5, rtol=0)
    assert torch.equal(back[1:], x[1:])
    assert back.abs().max() <= 100.0 + 1e-4
