"""The quantized KV cache (int8 / fp8 e4m3 / fp8 e5m2): the compiled kernel against the torch reference, per ISA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagemill.attention.backends.torch_paged import TorchPagedAttention
from pagemill.attention.kv_quant import head_dim_of, num_scales, pack_rows, row_width, scale_dtype, unpack_rows
from tests.attention.test_backends import _batch, _fused_inputs, _Layer

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def _quantized_cache(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float reference cache [2, NB, BS, Hk, D] as the torch reference's quantized cache [2, NB, BS, Hk, row]."""
    return pack_rows(cache, dtype).view(dtype)


def _kernel_layout(qcache: torch.Tensor) -> torch.Tensor:
    """The reference quantized cache with each K block as [Hk, D, BS] codes then [Hk, S, BS] scales (the kernel's;
    S scales per row, each sb bytes)."""
    out = qcache.clone()
    nb, bs, hk, w = qcache.shape[1:]
    d = head_dim_of(w, qcache.dtype)
    ns, sb = num_scales(d, qcache.dtype), scale_dtype(qcache.dtype).itemsize
    src = qcache[0].view(torch.uint8)
    blocks = out[0].view(torch.uint8).view(nb, -1)
    blocks[:, : hk * d * bs].view(nb, hk, d, bs).copy_(src[..., :d].permute(0, 2, 3, 1))
    blocks[:, hk * d * bs :].view(nb, hk, ns, bs, sb).copy_(src[..., d:].view(nb, bs, hk, ns, sb).permute(0, 2, 3, 1, 4))
    return out


def _reference_layout(kcache: torch.Tensor) -> torch.Tensor:
    """Inverse of _kernel_layout."""
    out = kcache.clone()
    nb, bs, hk, w = kcache.shape[1:]
    d = head_dim_of(w, kcache.dtype)
    ns, sb = num_scales(d, kcache.dtype), scale_dtype(kcache.dtype).itemsize
    blocks = kcache[0].view(torch.uint8).view(nb, -1)
    dst = out[0].view(torch.uint8)
    dst[..., :d].copy_(blocks[:, : hk * d * bs].view(nb, hk, d, bs).permute(0, 3, 1, 2))
    dst[..., d:].view(nb, bs, hk, ns, sb).copy_(blocks[:, hk * d * bs :].view(nb, hk, ns, bs, sb).permute(0, 3, 1, 2, 4))
    return out


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_layout_helpers_round_trip(dtype):
    """The test's own layout conversion is a bijection (so the cache comparisons below mean something)."""
    cache = _quantized_cache(torch.randn(2, 5, 4, 3, 32), dtype)
    k = _kernel_layout(cache)
    assert not torch.equal(k.view(torch.uint8), cache.view(torch.uint8))
    assert torch.equal(_reference_layout(k).view(torch.uint8), cache.view(torch.uint8))


def test_row_formats():
    """int8: a float16 scale per 16 channels (1.125 bytes a channel); fp8: one float32 scale per row."""
    assert row_width(64, torch.int8) == 64 + 4 * 2 and row_width(256, torch.int8) == 256 + 16 * 2
    assert row_width(64, torch.float8_e4m3fn) == row_width(64, torch.float8_e5m2) == 68
    assert row_width(64, torch.float32) == 64
    assert row_width(8, torch.int8) == 10 and row_width(72, torch.int8) == 72 + 5 * 2  # a partial last group
    for d in range(1, 300):
        for dtype in QUANT_DTYPES:
            assert head_dim_of(row_width(d, dtype), dtype) == d


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 32), (8, 1, 32), (4, 4, 32), (4, 2, 8), (4, 2, 40), (2, 1, 22)])
def test_quantized_kernel_matches_torch_reference(dtype, window, block_size, hq, hk, d):
    """Decodes, context chunks and fresh prefills: same output as the reference and the same cache bytes (head_dim
    8, 40 and 22: int8 rows whose last group of channels is partial)."""
    from pagemill.attention.backends.cpu_paged import CpuPagedAttention

    rng = np.random.default_rng(0)
    specs = [(5, 1), (40, 1), (0, 1), (17, 6), (3, 30), (0, 25), (0, 3)]
    md, cache, q, k, v = _batch(rng, specs, block_size, 64, hk, d, hq)
    qcache = _quantized_cache(cache, dtype)
    layer = _Layer(hq, hk, d, window)
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
    from pagemill.attention.backends.cpu_paged import CpuPagedAttention

    rng = np.random.default_rng(1)
    specs = [(5, 1), (40, 1), (17, 6), (0, 9)]
    hq, hk, d = 9, 3, 64
    md, cache, q, k, v = _batch(rng, specs, 16, 32, hk, d, hq)
    qcache = _quantized_cache(cache, dtype)
    layer = _Layer(hq, hk, d, None)
    rotary, positions, qkv, q_rot, k_rot = _fused_inputs(specs, q, k, v, 128)
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


def test_int8_groups_have_their_own_scales():
    """An outlier channel sets only its group's scale: the other groups of the row keep their resolution."""
    x = torch.randn(5, 64) * 0.01
    x[:, 3] = 50.0  # an outlier key channel, as Gemma 3's
    back = unpack_rows(pack_rows(x, torch.int8), torch.int8, torch.float32)
    rest = back[:, 16:] - x[:, 16:]
    assert rest.abs().max() <= 0.5 * x[:, 16:].abs().amax() / 127 * 1.01  # half a step of its own group's grid
    assert (back[:, 3] - 50.0).abs().max() < 50.0 / 127
    rows = pack_rows(x, torch.int8)
    scales = rows[:, 64:].contiguous().view(torch.float16).float()
    assert scales.shape == (5, 4) and (scales[:, 0] > 100 * scales[:, 1:].max()).all()


def test_int8_rows_quantize_per_token_and_head():
    """Each row gets its own scale: a large row does not crush a small one, and zero rows stay zero."""
    x = torch.zeros(3, 2, 16)
    x[0, 0] = torch.linspace(-100, 100, 16)
    x[0, 1] = torch.linspace(-1e-3, 1e-3, 16)
    rows = pack_rows(x, torch.int8)
    back = unpack_rows(rows, torch.int8, torch.float32)
    torch.testing.assert_close(back[0, 1], x[0, 1], atol=1e-5, rtol=0)
    assert torch.equal(back[1:], x[1:])
    assert back.abs().max() <= 100.0 * (1 + 2**-11)  # the float16 scale's rounding, at most


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("d", [64, 40])
def test_fused_write_is_torch_quantize_byte_for_byte(dtype, d):
    """The fused RoPE kernel's quantized write (C++, csrc/cpu/kv_rows.cpp) stores exactly kv_quant.quantize's bytes
    and leaves k, v as stored, over 40k values of every magnitude (position 0: RoPE is the identity there)."""
    from pagemill.kernels.build import load_kernels

    kernel = load_kernels()
    torch.manual_seed(7)
    t, hq, hk, bs, nb = 64, 2, 8, 16, 9
    scale = torch.logspace(-6, 4, t * hk).view(t, hk, 1)  # scales spanning float16's range and beyond
    k, v = torch.randn(t, hk, d) * scale, torch.randn(t, hk, d) * scale.flip(0)
    # exact ties x / scale = c + 1/2 (scale 3/256, a float16; each group's max 127 * scale): round half to even, and
    # a reciprocal multiply (1 / scale inexact) lands on either side of them
    ties = (torch.arange(-63, 63, dtype=torch.float32) + 0.5) * (3 / 256)
    group = torch.cat([torch.tensor([127 * 3 / 256]), ties[torch.randperm(len(ties))[:15]]])
    k[:8], v[:8] = group.repeat(8, hk, d // 16 + 1)[..., :d], -group.repeat(8, hk, d // 16 + 1)[..., :d]
    qkv = torch.cat([torch.randn(t, hq * d), k.flatten(1), v.flatten(1)], dim=1)
    slots = torch.randperm(nb * bs)[:t]
    cos, sin = torch.ones(1, d), torch.zeros(1, d)
    q_out, k_out, v_out = torch.empty(t, hq, d), torch.empty(t, hk, d), torch.empty(t, hk, d)
    kcache = torch.zeros(2, nb, bs, hk, row_width(d, dtype), dtype=torch.uint8).view(dtype)
    kernel.rope_and_cache(q_out, k_out, v_out, qkv, torch.zeros(t, dtype=torch.int64), cos, sin, kcache[0],
                          kcache[1], slots, None, None, 0.0)
    ref = torch.zeros_like(kcache.view(torch.uint8))
    ref[0].view(-1, hk, row_width(d, dtype))[slots] = pack_rows(k, dtype)
    ref[1].view(-1, hk, row_width(d, dtype))[slots] = pack_rows(v, dtype)
    back = _reference_layout(kcache).view(torch.uint8)
    assert torch.equal(back[1], ref[1]) and torch.equal(back[0], ref[0])
    assert torch.equal(k_out, unpack_rows(pack_rows(k, dtype), dtype, torch.float32))
    assert torch.equal(v_out, unpack_rows(pack_rows(v, dtype), dtype, torch.float32))
