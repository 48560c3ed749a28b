"""The quantized KV cache (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2 / int8): storage dtypes and the row format.

Every cached (token, KV head) row holds head_dim one-byte codes followed by its float32 scale (4 bytes), so a row is
head_dim + 4 bytes and the scales live inside the cache blocks: swap, copy-on-write, draft caches and KV connectors
copy whole blocks and carry the scales with them. Scales are per token and per head for every quantized dtype:
scale = max |x| / qmax (qmax 127 for int8, 448 for e4m3, 57344 for e5m2), code = x / scale rounded (int8: to
nearest, clamped to +-127; fp8: torch's round-to-nearest-even cast). A value reads back as code * scale.
"""

from __future__ import annotations

from typing import Any

import torch

# vLLM's names -> the storage dtype of the codes ("fp8" is e4m3, as in vLLM).
QUANT_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
_QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}
SCALE_BYTES = 4  # one float32 scale per (token, KV head) row


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the KV cache is allocated in for a `kv_cache_dtype` name (auto: the model's dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in QUANT_KV_CACHE_DTYPES:
        return QUANT_KV_CACHE_DTYPES[kv_cache_dtype]
    return getattr(torch, kv_cache_dtype)


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds quantized rows (codes + a scale per token and head)."""
    return dtype in _QMAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, KV head) row in a cache of `dtype`: head_dim, plus the scale's bytes when quantized."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] as uint8 bytes, float32 scales [...]) with one scale per row."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    qmax = _QMAX[dtype]
    scale = amax / qmax
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    y = xf * inv.unsqueeze(-1)
    if dtype == torch.int8:
        codes = y.round().clamp_(-qmax, qmax).to(torch.int8)
    else:
        codes = y.clamp_(-qmax, qmax).to(dtype)
    return codes.view(torch.uint8), scale


def pack_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] -> cache rows [..., D + 4] uint8 (codes then the float32 scale's bytes)."""
    codes, scale = quantize(x, dtype)
    return torch.cat([codes, scale.unsqueeze(-1).view(torch.uint8)], dim=-1)


def unpack_rows(rows: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., D + 4] (uint8) -> the values they hold [..., D] in `out_dtype` (codes times the scale)."""
    d = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :d].contiguous().view(dtype).float()
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (codes * scale).to(out_dtype)


def as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded as a cache of `dtype` stores it, in x's dtype (fresh prefills attend to what decodes will see)."""
    if is_quantized(dtype):
        return unpack_rows(pack_rows(x, dtype), dtype, x.dtype)
    return x.to(dtype).to(x.dtype)


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, backend: Any) -> torch.dtype:
    """The storage dtype for `kv_cache_dtype`, or a ValueError naming the field when `backend` cannot read it."""
    dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
    supported = backend.capabilities.kv_cache_dtypes
    if dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} ({dtype}) is not supported by the {backend.name} "
                         f"attention backend (it reads {names}).")
    return dtype
