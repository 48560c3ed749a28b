"""The quantized KV cache (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2 / int8): storage dtypes and the row format.

Every cached (token, KV head) row holds head_dim one-byte codes followed by its scales, so the scales live inside
the cache blocks: swap, copy-on-write, draft caches and KV connectors copy whole blocks and carry them along.
int8 rows have one float16 scale per group of INT8_GROUP (16) channels (ceil(head_dim / 16) scales, the last group
partial when head_dim is not a multiple of 16; row = 1.125 head_dim bytes): a few outlier channels then set only
their own group's scale. fp8 rows keep one float32 scale per row (e4m3 / e5m2 carry their own exponent, so groups
do not help them): row = head_dim + 4 bytes.
scale = max |x| / qmax over the group (qmax 127 for int8, 448 for e4m3, 57344 for e5m2); int8: the scale is rounded
to float16 first and code = x / scale rounded to nearest (ties to even), clamped to +-127; fp8: code = x / scale by
torch's round-to-nearest-even cast. A value reads back as code * scale.
"""

from __future__ import annotations

from typing import Any

import torch

# vLLM's names -> the storage dtype of the codes ("fp8" is e4m3, as in vLLM).
QUANT_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
_QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}
INT8_GROUP = 16  # channels per scale in an int8 row (pagemill/csrc/kernels.h kKvInt8Group)
_SCALE_DTYPE = {torch.float8_e4m3fn: torch.float32, torch.float8_e5m2: torch.float32, torch.int8: torch.float16}
_F16_MAX = 65504.0


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the KV cache is allocated in for a `kv_cache_dtype` name (auto: the model's dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in QUANT_KV_CACHE_DTYPES:
        return QUANT_KV_CACHE_DTYPES[kv_cache_dtype]
    return getattr(torch, kv_cache_dtype)


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds quantized rows (codes, then their scales)."""
    return dtype in _QMAX


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a quantized cache's scales: float16 for int8, float32 for fp8."""
    return _SCALE_DTYPE[dtype]


def group_size(head_dim: int, dtype: torch.dtype) -> int:
    """Channels per scale in a row of a quantized cache of `dtype`: INT8_GROUP for int8, the whole row for fp8."""
    return INT8_GROUP if dtype == torch.int8 else head_dim


def num_scales(head_dim: int, dtype: torch.dtype) -> int:
    """Scales per (token, KV head) row of a quantized cache of `dtype` (int8: a partial last group counts)."""
    return -(-head_dim // group_size(head_dim, dtype))


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, KV head) row in a cache of `dtype`: head_dim, plus the scales' bytes when quantized."""
    if not is_quantized(dtype):
        return head_dim
    return head_dim + num_scales(head_dim, dtype) * _SCALE_DTYPE[dtype].itemsize


def head_dim_of(width: int, dtype: torch.dtype) -> int:
    """The head_dim whose quantized row is `width` bytes (the inverse of row_width)."""
    if dtype == torch.int8:  # width = D + 2 ceil(D / 16), increasing in D: ceil(width / 18) groups
        return width - -(-width // (INT8_GROUP + 2)) * _SCALE_DTYPE[dtype].itemsize
    return width - _SCALE_DTYPE[dtype].itemsize


def row_format(kv_cache_dtype: str) -> str:
    """A tag of a kv_cache_dtype's quantized row format ("" for float caches), for keys of stored blocks: blocks
    written in another format never match."""
    dtype = QUANT_KV_CACHE_DTYPES.get(kv_cache_dtype)
    if dtype is None:
        return ""
    group = f"g{INT8_GROUP}" if dtype == torch.int8 else "row"
    return f"{group}-{str(_SCALE_DTYPE[dtype]).removeprefix('torch.')}"


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] as uint8 bytes, scales [..., D / group] in scale_dtype(dtype))."""
    d = x.shape[-1]
    g, ns = group_size(d, dtype), num_scales(d, dtype)
    xf = x.float()
    if ns * g != d:  # a partial last group: zeros do not change its max
        xf = torch.nn.functional.pad(xf, (0, ns * g - d))
    xf = xf.reshape(*x.shape[:-1], ns, g)
    qmax = _QMAX[dtype]
    amax = xf.abs().amax(-1)
    if dtype == torch.int8:
        scale = (amax / qmax).clamp_(max=_F16_MAX).to(torch.float16)
        sf = scale.float()
        y = xf / torch.where(sf > 0, sf, torch.ones_like(sf)).unsqueeze(-1)
        codes = y.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        scale = amax / qmax
        inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
        codes = (xf * inv.unsqueeze(-1)).clamp_(-qmax, qmax).to(dtype)
    return codes.reshape(*x.shape[:-1], ns * g)[..., :d].contiguous().view(torch.uint8), scale


def pack_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] -> cache rows [..., row_width(D)] uint8 (codes, then the scales' bytes)."""
    codes, scale = quantize(x, dtype)
    return torch.cat([codes, scale.contiguous().view(torch.uint8)], dim=-1)


def unpack_rows(rows: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row_width(D)] (uint8) -> the values they hold [..., D] in `out_dtype` (codes times scales)."""
    d = head_dim_of(rows.shape[-1], dtype)
    g, ns = group_size(d, dtype), num_scales(d, dtype)
    codes = rows[..., :d].contiguous().view(dtype).float()
    scale = rows[..., d:].contiguous().view(_SCALE_DTYPE[dtype]).float()
    return (codes * scale.repeat_interleave(g, dim=-1)[..., :d]).to(out_dtype)


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
