"""The CUDA platform: the model and KV cache on one NVIDIA GPU (torch device "cuda").

bfloat16 by default, NCCL between ranks, pagemill's own Triton kernels for paged attention and the fused layer ops
(the torch reference stays the oracle), the KV cache sized as vLLM sizes it: `gpu_memory_utilization` (default
0.9) of the device's memory, less what a profiled forward at `max_num_batched_tokens` used (worker/gpu_worker.py;
`kv_cache_memory` still wins when given). Its worker (`GpuWorker`) is written device-generically: the same code runs
on the CPU (`worker_cls=...GpuWorker, attention_backend="triton"`, Triton's interpreter), which is how CI tests it.

Nothing here imports torch.cuda state at import time: `is_available()` asks torch only when called.
"""

from __future__ import annotations

from typing import ClassVar

from pagemill.config import parse_size
from pagemill.platforms.interface import Platform, PlatformEnum

_BACKENDS = "pagemill.attention.backends"
TRITON_PAGED = f"{_BACKENDS}.triton_paged.TritonPagedAttention"
TORCH_PAGED = f"{_BACKENDS}.torch_paged.TorchPagedAttention"
GPU_WORKER = "pagemill.worker.gpu_worker.GpuWorker"
TORCH_OPS = "pagemill.kernels.ops.TorchLayerOps"
TRITON_OPS = "pagemill.kernels.triton_ops.TritonLayerOps"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

NOT_AVAILABLE = ("PAGEMILL_DEVICE=cuda / device='cuda': no CUDA device is visible to torch here (torch.cuda."
                 "is_available() is False); use device='cpu' (or auto).")


def no_device_communicator(group, rank: int, world_size: int, timeout_s: float) -> None:
    """NCCL's own all-reduce (torch.distributed) serves a GPU group: no custom communicator yet."""
    return None


class CudaPlatform(Platform):
    """One NVIDIA GPU per rank: bfloat16, NCCL, Triton attention, KV cache from gpu_memory_utilization."""

    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_dtype_name = "bfloat16"
    attention_backends: ClassVar[dict[str, str]] = {"triton": TRITON_PAGED, "torch": TORCH_PAGED}
    auto_attention_backends = ("triton",)
    # weight-only int8/int4 and GGUF's blocks use the CPU kernels' layouts: a GGUF file is dequantized at load
    # (quantization auto resolves to none here), to the model's dtype
    supported_quantization = ("none",)
    worker_cls = GPU_WORKER
    device_communicator = "pagemill.platforms.cuda.no_device_communicator"
    # Triton's layer ops with Triton attention (RoPE included), the torch reference with the torch one (never the
    # CPU's compiled kernels, also when the GPU runner runs on the CPU)
    layer_ops: ClassVar[dict[str, tuple[str, ...]]] = {"triton": (TRITON_OPS, TORCH_OPS), "*": (TORCH_OPS,)}

    def __init__(self) -> None:
        if not self.is_available():
            raise RuntimeError(NOT_AVAILABLE)

    @staticmethod
    def is_available() -> bool:
        """Whether torch sees a CUDA device (False, without error, on a CPU-only torch)."""
        try:
            import torch
        except ImportError:
            return False
        return bool(torch.cuda.is_available())

    def get_attn_backend_cls(self, selected: str, batch_invariant: bool, kv_cache_layout: str) -> list[str]:
        """Triton paged attention (auto) or the torch reference; the CPU-only options are refused by name."""
        names = self.attention_backend_names()
        if selected not in names:
            raise ValueError(f"attention_backend must be one of {', '.join(names)}, got {selected!r}.")
        if kv_cache_layout == "virtual" and selected not in ("auto", "triton"):
            raise ValueError("kv_cache_layout='virtual' on CUDA reads its ranges with the Triton kernel: it cannot be "
                             f"combined with attention_backend={selected!r} (leave it 'auto').")
        if batch_invariant:
            raise ValueError("batch_invariant=True needs the compiled CPU kernels: not available on the CUDA platform.")
        if selected == "auto":
            return [self.attention_backends[name] for name in self.auto_attention_backends]
        return [self.attention_backends[selected]]

    def kv_cache_memory_bytes(self, kv_cache_memory: int | str | None, gpu_memory_utilization: float | None) -> int:
        """`kv_cache_memory` when given; else 0: the worker sizes the cache from gpu_memory_utilization after
        profiling a forward (GpuWorker.determine_num_available_blocks)."""
        if kv_cache_memory is not None:
            return parse_size(kv_cache_memory)
        return 0

    def init_threads(self, num_threads: int | None) -> int:
        """Host threads: the GPU does the math; torch's default is kept unless asked."""
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)
        return torch.get_num_threads()

    @staticmethod
    def describe() -> dict[str, str]:
        """GPU, driver / CUDA versions and the attention backend, for `pagemill env`."""
        import torch

        props = torch.cuda.get_device_properties(0)
        return {"gpu": f"{props.name} ({props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor})",
                "gpu_count": str(torch.cuda.device_count()), "cuda": str(torch.version.cuda),
                "attention_backend": "triton"}
