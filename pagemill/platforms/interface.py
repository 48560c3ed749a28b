"""The Platform interface: what differs between the devices pagemill runs on, in one place (vLLM's `Platform`).

A platform states its device facts (torch device, default dtype, distributed backend, quantization methods), names
the classes that run on it (worker, attention backends, device communicator) by import path so that it imports
nothing above it, sizes the KV cache, and sets up the process and its threads.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from pagemill.config import EngineConfig


class PlatformEnum(enum.Enum):
    """The kinds of device pagemill knows."""

    CPU = "cpu"
    CUDA = "cuda"


class Platform:
    """One kind of device; `pagemill.platforms.current_platform` is the one this process runs on."""

    _enum: ClassVar[PlatformEnum]
    device_name: ClassVar[str]  # what logs and errors call the device
    device_type: ClassVar[str]  # torch's device type
    dist_backend: ClassVar[str]  # torch.distributed backend of the tensor / pipeline process group
    # torch dtype name that dtype="auto" resolves to
    default_dtype_name: ClassVar[str]
    # attention backends by the name EngineArgs.attention_backend gives them -> class import path; "auto" tries
    # `auto_attention_backends` in order (the first that builds here)
    attention_backends: ClassVar[dict[str, str]]
    auto_attention_backends: ClassVar[tuple[str, ...]]
    # resolved ModelConfig.quantization values this device's linear methods run
    supported_quantization: ClassVar[tuple[str, ...]]
    # the worker class (worker.worker_base.WorkerBase) one rank runs; it picks the model runner for the model
    worker_cls: ClassVar[str]
    # (group, rank, world_size, timeout_s) -> the fast collectives of a tensor-parallel group, or None
    device_communicator: ClassVar[str]
    # the layer-ops tables (kernels.ops.TorchLayerOps and subclasses) by attention backend name ("*": any other),
    # import paths tried in order (the first whose kernels are available is used; the torch reference at worst)
    layer_ops: ClassVar[dict[str, tuple[str, ...]]]

    def is_cpu(self) -> bool:
        """Whether this is the CPU platform."""
        return self._enum == PlatformEnum.CPU

    def is_cuda(self) -> bool:
        """Whether this is the CUDA platform."""
        return self._enum == PlatformEnum.CUDA

    @property
    def device(self) -> torch.device:
        """The torch device tensors of the model, KV cache and sampling live on."""
        import torch

        return torch.device(self.device_type)

    @property
    def default_dtype(self) -> torch.dtype:
        """The model dtype that dtype="auto" means here."""
        import torch

        return getattr(torch, self.default_dtype_name)

    def attention_backend_names(self) -> tuple[str, ...]:
        """What EngineArgs.attention_backend may name here ("auto" first)."""
        return ("auto", *self.attention_backends)

    def get_attn_backend_cls(self, selected: str, batch_invariant: bool, kv_cache_layout: str) -> list[str]:
        """Import paths of the attention backends to try, in order (the first that builds is used), for the user's
        `attention_backend`; a ValueError names the fields that cannot go together."""
        raise NotImplementedError(f"the {self.device_name} platform does not choose attention backends")

    @classmethod
    def get_layer_ops_cls(cls, attn_backend: str) -> tuple[str, ...]:
        """Import paths of the layer-ops tables to try, in order, for the attention backend named `attn_backend`."""
        return cls.layer_ops.get(attn_backend, cls.layer_ops["*"])

    def kv_cache_memory_bytes(self, kv_cache_memory: int | str | None, gpu_memory_utilization: float | None) -> int:
        """Bytes for the KV cache from the user's `kv_cache_memory` / `gpu_memory_utilization` (None: defaults)."""
        raise NotImplementedError(f"the {self.device_name} platform does not size KV caches")

    def set_up_process_env(self) -> None:
        """Environment defaults that must be set before torch loads its runtimes (the user's own settings win)."""

    def init_threads(self, num_threads: int | None) -> int:
        """Set this process's torch intra-op threads (None: one per core); returns how many."""
        import os

        import torch

        num_threads = num_threads or os.cpu_count() or 1
        torch.set_num_threads(num_threads)
        return num_threads

    def rank_cores(self, world_size: int, bind: str | None = None) -> list[list[int] | None]:
        """Per worker rank, the CPU cores to pin it to (None: not pinned). Base: no pinning."""
        return [None] * world_size

    def pin_to_cores(self, cores: list[int] | None) -> int | None:
        """Pin this process to `cores`; returns how many threads that gives (None: unpinned). Base: no pinning."""
        return None

    def check_and_update_config(self, config: EngineConfig) -> None:
        """Check an engine configuration against what this device runs (a ValueError names the field)."""
        self.get_attn_backend_cls(config.attention_backend, config.batch_invariant,
                                  config.cache_config.kv_cache_layout)
        quantization = config.model_config.quantization
        if quantization not in self.supported_quantization:
            raise ValueError(f"quantization={quantization!r} does not run on the {self.device_name} platform "
                             f"(it runs {', '.join(self.supported_quantization)}).")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

