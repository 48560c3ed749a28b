"""The CUDA platform: declared, not available yet (the CUDA issue fills it in).

What it will provide: the model and KV cache on one NVIDIA GPU (torch device "cuda"), bfloat16 by default, NCCL
between ranks (with a custom all-reduce for a node's GPUs), attention backends for paged KV on the GPU (Triton
kernels tested against the torch reference), the KV cache sized as `gpu_memory_utilization` of the device memory left
after loading the model (`kv_cache_memory` still wins when given), and its own worker (`worker_cls`, meeting
tests/worker/test_worker_contract.py) and model runner (CUDA graphs). Until then, selecting it raises an error
saying so.
"""

from __future__ import annotations

from typing import ClassVar

from pagemill.platforms.interface import Platform, PlatformEnum

NOT_AVAILABLE = ("PAGEMILL_DEVICE=cuda: the CUDA platform is not available yet (pagemill runs on the CPU for now); "
                 "unset PAGEMILL_DEVICE or set it to cpu.")


class CudaPlatform(Platform):
    """NVIDIA GPUs (not available yet: constructing it raises RuntimeError)."""

    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_dtype_name = "bfloat16"
    attention_backends: ClassVar[dict[str, str]] = {}
    auto_attention_backends = ()
    supported_quantization = ()

    def __init__(self) -> None:
        raise RuntimeError(NOT_AVAILABLE)
