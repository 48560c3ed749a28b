"""Fused layer ops: the compiled kernel when it is loaded, else the pure-torch reference (HF's math).

Tensors are CPU tensors (the engine runs on CPUs only).

`out_dtype` is the dtype the consumer (usually the next matmul) wants, so the cast is fused in too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
import torch.nn.functional as F

from pagemill.kernels.build import load_kernels

_kernels: ModuleType | None = None


@contextmanager
def use_kernels(enabled: bool) -> Iterator[bool]:
    """Within the block, route the fused ops to the compiled kernels (if they build) or the torch reference.

    Scoped rather than global so engines with different backends can live in one process.
    """
    global _kernels
    previous, _kernels = _kernels, (load_kernels() if enabled else None)
    try:
        yield _kernels is not None
    finally:
        _kernels = previous


def kernels() -> ModuleType | None:
    """The loaded kernel module when the fused ops use it, else None."""
    return _kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """weight * x / rms(x), computed in float32, returned in `out_dtype`."""
    if _kernels is not None and weight.dtype == torch.float32:
        out = torch.empty(x.shape, dtype=out_dtype)
        _kernels.rms_norm(out, x.contiguous(), weight, eps)
        return out
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).to(out_dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); the kernel updates `residual` in place."""
    if _kernels is not None and residual.dtype == torch.float32 and weight.dtype == torch.float32:
        out = torch.empty(x.shape, dtype=out_dtype)
        _kernels.fused_add_rms_norm(out, x.contiguous(), residual, weight, eps)
        return out, residual
    residual = residual + x.to(residual.dtype)
    return rms_norm(residual, weight, eps, out_dtype), residual


def silu_and_mul(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim, in `out_dtype`."""
    if _kernels is not None:
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=out_dtype)
        _kernels.silu_and_mul(out, x.contiguous())
        return out
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(out_dtype)
