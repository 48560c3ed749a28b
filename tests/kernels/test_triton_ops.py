"""The Triton layer ops under Triton's interpreter against TorchLayerOps (HF's math): RMSNorm with and without the
residual add, SiLU- and GELU(tanh)-and-mul, float32 and half inputs, odd widths, several rows."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagemill.kernels.ops import TorchLayerOps  # noqa: E402
from pagemill.kernels.triton_ops import TritonLayerOps  # noqa: E402

REF = TorchLayerOps()
DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _every_kernel_variant():
    """(Overrides the directory's per-ISA parametrisation, if any: these kernels are Triton's.)"""
    yield


@pytest.fixture(scope="module")
def tri() -> TritonLayerOps:
    return TritonLayerOps()


def _on(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The inputs on the device the Triton kernels run on (TRITON_INTERPRET=0 with a GPU: compiled there)."""
    return [t.to(DEVICE) for t in tensors]


def _close(got: torch.Tensor, want: torch.Tensor, rounded_in: torch.dtype = torch.float32) -> None:
    """Equal to float32 rounding, or to half-precision rounding where the output or an intermediate the reference
    rounds (`rounded_in`) is half precision (an ulp of the device's rsqrt can flip such a rounding)."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-5 if want.dtype == torch.float32 and rounded_in == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("width", [64, 576, 1000])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.float32)])
def test_rms_norm(tri, width, dtype, out_dtype):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(2, 3, width, generator=gen) * 3).to(dtype)
    w = torch.randn(width, generator=gen)
    _close(tri.rms_norm(*_on(x, w), 1e-6, out_dtype), REF.rms_norm(x, w, 1e-6, out_dtype), dtype)
    residual = torch.randn(2, 3, width, generator=gen).to(dtype)
    got, got_res = tri.fused_add_rms_norm(*_on(x, residual, w), 1e-5, out_dtype)
    want, want_res = REF.fused_add_rms_norm(x, residual, w, 1e-5, out_dtype)
    _close(got, want, dtype)
    _close(got_res, want_res, dtype)


@pytest.mark.parametrize("width", [8, 1536, 2500])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activations(tri, width, dtype):
    gen = torch.Generator().manual_seed(width + 1)
    x = (torch.randn(5, 2 * width, generator=gen) * 4).to(dtype)
    _close(tri.silu_and_mul(x.to(DEVICE), dtype), REF.silu_and_mul(x, dtype))
    _close(tri.gelu_tanh_and_mul(x.to(DEVICE), torch.float32), REF.gelu_tanh_and_mul(x, torch.float32))


def test_the_check_can_fail(tri):
    """GELU and SiLU differ: comparing one against the other's reference fails."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError):
        _close(tri.gelu_tanh_and_mul(x.to(DEVICE), torch.float32), REF.silu_and_mul(x, torch.float32))


@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (256, 256), (32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary(tri, head_dim, rotary_dim, dtype):
    """RoPE (rotate-half, partial rotary dims passed through) at scattered positions of q and k views taken from one
    fused qkv row, as the attention layer hands them: equal to RotaryEmbedding's torch math."""
    from types import SimpleNamespace

    from pagemill.layers.rotary import RotaryEmbedding

    cfg = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": rotary_dim / head_dim},
                          head_dim=head_dim, hidden_size=head_dim * 4, num_attention_heads=4)
    rope = RotaryEmbedding(cfg, 300, dtype).to("cpu")  # (its tables start on the platform's device)
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    t, hq, hk = 5, 4, 2
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :hq * head_dim].view(t, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hk) * head_dim].view(t, hk, head_dim)
    positions = torch.tensor([0, 7, 299, 1, 128])
    want_q, want_k = rope(positions, q, k)
    dq, dk, dpos, cos, sin = _on(q, k, positions, rope.cos, rope.sin)
    got_q, got_k = tri.rotary(dpos, dq, dk, cos, sin, rope.rotary_dim)
    _close(got_q, want_q)
    _close(got_k, want_k)
    if dtype == torch.bfloat16:  # each rounding as torch's: the same bits
        assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_k.cpu(), want_k)
