"""The fused layer-op kernels (norms, SiLU / GELU-tanh and mul, RoPE + cache write) vs the pure-torch reference."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagemill.kernels import load_kernels
from pagemill.kernels.ops import KernelLayerOps, TorchLayerOps
from pagemill.layers.rotary import RotaryEmbedding
from tests.conftest import requires_kernels

pytestmark = requires_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.dtype == b.dtype
    torch.testing.assert_close(a.float(), b.float(), rtol=TOL[dtype], atol=TOL[dtype])


def _both(fn):
    """fn(ops) with the kernels and with the torch reference."""
    return fn(KernelLayerOps(load_kernels())), fn(TorchLayerOps())


@pytest.mark.parametrize("hidden", [576, 100])
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_rms_norm_matches_reference(hidden: int, in_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    x = torch.randn(7, hidden).to(in_dtype)
    w = torch.rand(hidden) + 0.5
    fast, ref = _both(lambda ops: ops.rms_norm(x, w, 1e-5, out_dtype))
    # the reference rounds to the input dtype before scaling (HF does); tolerate the coarser of the two
    _close(fast, ref, max(in_dtype, out_dtype, key=lambda dt: TOL[dt]))


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_fused_add_rms_norm_updates_residual(in_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    x = torch.randn(5, 576).to(in_dtype)
    residual = torch.randn(5, 576)
    w = torch.rand(576) + 0.5
    fast, ref = _both(lambda ops: ops.fused_add_rms_norm(x, residual.clone(), w, 1e-6, out_dtype))
    torch.testing.assert_close(fast[1], ref[1], rtol=1e-6, atol=1e-6)  # residual + x, exact in fp32
    torch.testing.assert_close(fast[1], residual + x.float(), rtol=1e-6, atol=1e-6)
    _close(fast[0], ref[0], out_dtype)


@pytest.mark.parametrize("inter", [1536, 40])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_silu_and_mul_matches_reference(inter: int, in_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    x = (torch.randn(6, 2 * inter) * 3).to(in_dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 20.0, -20.0, 90.0, -90.0])  # exp(90) overflows: no NaN
    x[1, :2] = torch.tensor([-1000.0, -200.0])
    fast, ref = _both(lambda ops: ops.silu_and_mul(x, out_dtype))
    assert torch.isfinite(fast).all()
    _close(fast, ref.to(out_dtype), torch.float16 if torch.float16 in (in_dtype, out_dtype) else torch.float32)


@pytest.mark.parametrize("inter", [2048, 40])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_gelu_tanh_and_mul_matches_reference(inter: int, in_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    x = (torch.randn(6, 2 * inter) * 3).to(in_dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 20.0, -20.0, 90.0, -90.0])  # tails: tanh saturates to +-1
    fast, ref = _both(lambda ops: ops.gelu_tanh_and_mul(x, out_dtype))
    _close(fast, ref.to(out_dtype), torch.float16 if torch.float16 in (in_dtype, out_dtype) else torch.float32)


@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (4, 2, 40)])
def test_rope_and_cache_matches_rotary_and_index_copy(qkv_dtype: torch.dtype, hq: int, hk: int, d: int) -> None:
    cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk, rope_theta=10000.0)
    rotary = RotaryEmbedding(cfg, 256, torch.float32)
    t, num_slots = 11, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(qkv_dtype)
    positions = torch.randint(0, 256, (t,))
    slots = torch.randperm(num_slots)[: t - 2]  # the last two tokens are padding: no cache write
    k_cache, v_cache = torch.zeros(num_slots, hk, d), torch.zeros(num_slots, hk, d)
    q, k, v = torch.empty(t, hq, d), torch.empty(t, hk, d), torch.empty(t, hk, d)
    load_kernels().rope_and_cache(q, k, v, qkv, positions, rotary.cos, rotary.sin, k_cache.view(num_slots, 1, hk, d),
                                  v_cache.view(num_slots, 1, hk, d), slots)
    q_ref, k_ref, v_ref = qkv.float().split([hq * d, hk * d, hk * d], dim=-1)
    q_ref, k_ref = rotary(positions, q_ref.reshape(t, hq, d), k_ref.reshape(t, hk, d))
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, v_ref.reshape(t, hk, d))
    torch.testing.assert_close(k_cache[slots], k[: t - 2])
    torch.testing.assert_close(v_cache[slots], v[: t - 2])
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert k_cache[untouched].abs().sum() == 0 and v_cache[untouched].abs().sum() == 0


@pytest.mark.parametrize("hq,hk,d", [(4, 1, 256), (4, 2, 40)])
def test_rope_and_cache_with_qk_norm_matches_norm_then_rotary(hq: int, hk: int, d: int) -> None:
    """Qwen3 / Gemma 3: the per-head RMSNorm of q and k (own scales) before RoPE, in the same kernel pass."""
    cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk, rope_theta=1e6, head_dim=d)
    rotary = RotaryEmbedding(cfg, 256, torch.float32)
    t, num_slots = 7, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d) * 4
    positions = torch.randint(0, 256, (t,))
    slots = torch.randperm(num_slots)[:t]
    q_w, k_w, eps = torch.rand(d) + 0.5, torch.rand(d) + 0.5, 1e-6
    k_cache, v_cache = torch.zeros(num_slots, 1, hk, d), torch.zeros(num_slots, 1, hk, d)
    q, k, v = torch.empty(t, hq, d), torch.empty(t, hk, d), torch.empty(t, hk, d)
    load_kernels().rope_and_cache(q, k, v, qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, slots,
                                  q_norm=q_w, k_norm=k_w, norm_eps=eps)
    ops = TorchLayerOps()
    q_ref, k_ref, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q_ref = ops.rms_norm(q_ref.reshape(t, hq, d), q_w, eps, torch.float32)
    k_ref = ops.rms_norm(k_ref.reshape(t, hk, d), k_w, eps, torch.float32)
    q_ref, k_ref = rotary(positions, q_ref, k_ref)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache.view(num_slots, hk, d)[slots], k)
    with pytest.raises(RuntimeError, match="contiguous"):
        load_kernels().rope_and_cache(q, k, v, qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache,
                                      torch.arange(2 * t)[::2], q_norm=q_w, k_norm=k_w, norm_eps=eps)
