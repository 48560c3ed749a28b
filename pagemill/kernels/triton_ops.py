"""The fused layer ops as Triton kernels (the CUDA platform's; Triton's interpreter runs them on the CPU for tests):
RMSNorm, RMSNorm with the residual add, SiLU-and-mul and GELU(tanh)-and-mul, each one program per row, in float32
and cast to `out_dtype` on the way out, and RoPE (rotate-half, partial rotary dims) one program per (token, head).
TorchLayerOps is their reference; the LoRA delta stays torch's (matmuls).
"""

from __future__ import annotations

import os

import torch

from pagemill.kernels.ops import TorchLayerOps

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

if triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
    from pagemill.utils.triton_interpreter import patch_interpreter_scalars

    patch_interpreter_scalars()

if triton is not None:
    from pagemill.kernels.triton_common import cast_rne

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, eps, stride_x, stride_r, stride_o,
                         stride_ro, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        """out = w * (h / rms(h)) for h = x (+ residual, written to res_out): one row per program."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            h = cast_rne(h, res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_ro + cols, h, mask=mask)
            h = h.to(tl.float32)  # as the reference: normalise the stored sum
        inv = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # HF rounds the normalised row to the dtype of what it normalised before the weight multiplies it
        if HAS_RESIDUAL:
            normed = cast_rne(h * inv, res_out_ptr.dtype.element_ty).to(tl.float32)
        else:
            normed = cast_rne(h * inv, x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, cast_rne(w * normed, out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gated_act_kernel(x_ptr, out_ptr, n, stride_x, stride_o, GELU: tl.constexpr, BLOCK: tl.constexpr):
        """out = act(gate) * up for a row [gate | up] of 2n values: SiLU, or GELU with the tanh approximation."""
        row = tl.program_id(0)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n
            gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
            if GELU:
                inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
                act = 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
            else:
                act = gate / (1.0 + tl.exp(-gate))
            # as torch computes it in the input's dtype: the activation and the product rounded to it
            act = cast_rne(act, x_ptr.dtype.element_ty).to(tl.float32)
            prod = cast_rne(act * up, x_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out_ptr + row * stride_o + cols, cast_rne(prod, out_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _rope_kernel(q_ptr, q_out_ptr, k_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh,
                     stride_qot, stride_qoh, stride_kt, stride_kh, stride_kot, stride_koh, stride_c, HQ,
                     HEAD_DIM: tl.constexpr, HALF: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr):
        """Head h of token t, of q for h < HQ and of k after (one launch for both), rotated by its position's
        cos/sin (the first 2 * HALF features; the rest copied), each product and the sum rounded to the tensor's
        dtype as torch computes x * cos + rotate_half(x) * sin."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        if h < HQ:
            _rope_row(q_ptr + t * stride_qt + h * stride_qh, q_out_ptr + t * stride_qot + h * stride_qoh, cos_ptr,
                      sin_ptr, pos * stride_c, HEAD_DIM, HALF, H_PAD, D_PAD)
        else:
            hk = h - HQ
            _rope_row(k_ptr + t * stride_kt + hk * stride_kh, k_out_ptr + t * stride_kot + hk * stride_koh,
                      cos_ptr, sin_ptr, pos * stride_c, HEAD_DIM, HALF, H_PAD, D_PAD)

    @triton.jit
    def _rope_row(src, dst, cos_ptr, sin_ptr, c_off, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                  H_PAD: tl.constexpr, D_PAD: tl.constexpr):
        """One head's row `src` rotated into `dst` with the cos / sin row at `c_off`."""
        i = tl.arange(0, H_PAD)
        m = i < HALF
        ty = src.dtype.element_ty
        x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + c_off + i, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + c_off + HALF + i, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + c_off + i, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + c_off + HALF + i, mask=m, other=0.0).to(tl.float32)
        a1 = cast_rne(x1 * c1, ty).to(tl.float32)
        b1 = cast_rne(-x2 * s1, ty).to(tl.float32)
        a2 = cast_rne(x2 * c2, ty).to(tl.float32)
        b2 = cast_rne(x1 * s2, ty).to(tl.float32)
        tl.store(dst + i, cast_rne(a1 + b1, dst.dtype.element_ty), mask=m)
        tl.store(dst + HALF + i, cast_rne(a2 + b2, dst.dtype.element_ty), mask=m)
        if HEAD_DIM > 2 * HALF:  # partial rotary: the other features pass through
            d = 2 * HALF + tl.arange(0, D_PAD)
            dm = d < HEAD_DIM
            tl.store(dst + d, tl.load(src + d, mask=dm, other=0.0), mask=dm)


_ACT_BLOCK = 1024


class TritonLayerOps(TorchLayerOps):
    """RMSNorm (with and without the residual add), the gated activations and RoPE in Triton; the rest the
    reference's."""

    fused_rotary = True

    def __init__(self) -> None:
        if triton is None:
            raise RuntimeError("the Triton layer ops need the triton package (pip install triton)")

    @classmethod
    def create(cls) -> TritonLayerOps | None:
        """The Triton table, or None without the triton package."""
        return cls() if triton is not None else None

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1]).contiguous()

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
              out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = self._rows(x)
        out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
        res = self._rows(residual) if residual is not None else rows
        res_out = torch.empty(rows.shape, dtype=residual.dtype, device=x.device) if residual is not None else out
        n = rows.shape[1]
        _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, out, res_out, n, float(eps), rows.stride(0),
                                           res.stride(0), out.stride(0), res_out.stride(0),
                                           HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
        return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        """weight * x / rms(x), computed in float32, returned in `out_dtype`."""
        return self._norm(x, None, weight, eps, out_dtype)[0]

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x) in one pass."""
        out, res = self._norm(x, residual, weight, eps, out_dtype)
        return out, res

    def _gated(self, x: torch.Tensor, out_dtype: torch.dtype, gelu: bool) -> torch.Tensor:
        rows = self._rows(x)
        n = rows.shape[1] // 2
        out = torch.empty(rows.shape[0], n, dtype=out_dtype, device=x.device)
        _gated_act_kernel[(rows.shape[0],)](rows, out, n, rows.stride(0), out.stride(0), GELU=gelu,
                                            BLOCK=min(_ACT_BLOCK, triton.next_power_of_2(n)))
        return out.view(*x.shape[:-1], n)

    def silu_and_mul(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """silu(gate) * up for x = [gate | up] along the last dim, in `out_dtype`."""
        return self._gated(x, out_dtype, gelu=False)

    def gelu_tanh_and_mul(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """gelu_tanh(gate) * up for x = [gate | up] (Gemma's gated MLP), in `out_dtype`."""
        return self._gated(x, out_dtype, gelu=True)

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (rotate-half) of q [T, Hq, D] and k [T, Hk, D] at `positions` from the cos / sin tables
        [max_pos, rotary_dim]; features past rotary_dim pass through. New tensors, as the reference's; one launch
        for both (q's heads, then k's)."""
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        t, hq, d = q.shape
        if t == 0:
            return q_out, k_out
        if q.stride(2) != 1:
            q = q.contiguous()
        if k.stride(2) != 1:
            k = k.contiguous()
        half = rotary_dim // 2
        _rope_kernel[(t, hq + k.shape[1])](
            q, q_out, k, k_out, cos, sin, positions, q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1),
            k.stride(0), k.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0), hq, HEAD_DIM=d, HALF=half,
            H_PAD=triton.next_power_of_2(half), D_PAD=triton.next_power_of_2(max(1, d - 2 * half)))
        return q_out, k_out
