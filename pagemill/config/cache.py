"""CacheConfig: the KV cache's block size, memory budget, dtype, layout and prefix caching."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
               "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}

# fp8 / fp8_e4m3 / fp8_e5m2 / int8: one byte per element plus a float32 scale per token and head
# (attention/kv_quant.py); fp8 is e4m3, as in vLLM.
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
KV_CACHE_LAYOUTS = ("paged", "virtual")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
VIRTUAL_BLOCK_SIZES = tuple(1 << i for i in range(17))


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as '2GiB', '512MB', '1.5g'."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"kv_cache_memory must be a size like '2GiB' or a number of bytes, got {value!r}.")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


@dataclass
class CacheConfig:
    """Paged KV cache: block size, memory budget, prefix caching (the EngineArgs fields of the same names)."""

    block_size: int = 16
    kv_cache_memory: int = 2 * 2**30  # resolved to bytes by the platform
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "builtin"
    num_gpu_blocks_override: int | None = None
    swap_space: int = 4 * 2**30  # bytes (EngineArgs.swap_space is GiB)
    kv_cache_dtype: str = "auto"
    kv_cache_layout: str = "paged"  # virtual: worker/virtual_kv.py
    gpu_memory_utilization: float | None = None  # resolved: None on the CPU, 0.9 on CUDA when not given

    def __post_init__(self) -> None:
        if self.kv_cache_layout == "virtual":  # a block is a mapped chunk: up to the driver's 2 MiB and beyond
            if self.block_size not in VIRTUAL_BLOCK_SIZES:
                raise ValueError(f"block_size must be a power of two in [1, 65536] with kv_cache_layout='virtual', "
                                 f"got {self.block_size}.")
        elif self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}.")
        if self.prefix_caching_hash_algo not in ("builtin", "sha256"):
            raise ValueError("prefix_caching_hash_algo must be 'builtin' or 'sha256'.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}.")
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout must be one of {', '.join(KV_CACHE_LAYOUTS)}, "
                             f"got {self.kv_cache_layout!r}.")
