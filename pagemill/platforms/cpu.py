"""The CPU platform: PyTorch on the host's cores, pagemill's compiled CPU kernels where they build."""

from __future__ import annotations

import functools
import logging
import os
from typing import ClassVar

from pagemill.config import parse_size
from pagemill.platforms import cpu_binding
from pagemill.platforms.interface import Platform, PlatformEnum
from pagemill.utils.memory import available_memory_bytes

logger = logging.getLogger(__name__)

_BACKENDS = "pagemill.attention.backends"
CPU_PAGED = f"{_BACKENDS}.cpu_paged.CpuPagedAttention"
TORCH_PAGED = f"{_BACKENDS}.torch_paged.TorchPagedAttention"
CPU_INVARIANT = f"{_BACKENDS}.cpu_invariant.BatchInvariantCpuAttention"
VIRTUAL_CONTIGUOUS = f"{_BACKENDS}.virtual_contiguous.VirtualContiguousAttention"
TRITON_PAGED = f"{_BACKENDS}.triton_paged.TritonPagedAttention"
TORCH_OPS = "pagemill.kernels.ops.TorchLayerOps"
KERNEL_OPS = "pagemill.kernels.ops.KernelLayerOps"

DEFAULT_KV_CACHE_BYTES = 2 * 2**30


class CpuPlatform(Platform):
    """Float32 by default, gloo between ranks with a shared-memory all-reduce, the KV cache sized in bytes
    (`kv_cache_memory`), OpenMP threads that sleep when idle, and worker ranks pinned to their share of the cores."""

    _enum = PlatformEnum.CPU
    device_name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # float32 is the fastest exact dtype on CPUs without AMX
    default_dtype_name = "float32"
    # "triton": the CUDA platform's kernels run by Triton's interpreter (slow; it checks them on the CPU)
    attention_backends: ClassVar[dict[str, str]] = {"cpu": CPU_PAGED, "torch": TORCH_PAGED, "triton": TRITON_PAGED}
    auto_attention_backends = ("cpu", "torch")  # the compiled kernel when it builds, else the torch reference
    supported_quantization = ("none", "gguf", "int8", "int4", "gptq", "awq", "compressed-tensors", "fp8")
    worker_cls = "pagemill.worker.cpu_worker.CpuWorker"
    device_communicator = "pagemill.distributed.shm_communicator.create_shm_communicator"
    # the compiled CPU ops (torch's where they are not built); the torch attention reference gets the torch ops
    layer_ops: ClassVar[dict[str, tuple[str, ...]]] = {"torch": (TORCH_OPS,), "*": (KERNEL_OPS, TORCH_OPS)}

    def get_attn_backend_cls(self, selected: str, batch_invariant: bool, kv_cache_layout: str) -> list[str]:
        """The compiled CPU kernel (else the torch reference) for auto; kv_cache_layout="virtual" has its own
        (SDPA over contiguous KV; Triton's paged kernel on the GPU worker) and batch_invariant=True the kernel's
        fixed-order variant."""
        names = self.attention_backend_names()
        if selected not in names:
            raise ValueError(f"attention_backend must be one of {', '.join(names)}, got {selected!r}.")
        if kv_cache_layout == "virtual":
            if selected == "triton":  # the GPU worker's way (run on the CPU in CI): the paged kernel over ranges
                return [TRITON_PAGED]
            if selected != "auto":
                raise ValueError("kv_cache_layout='virtual' has its own attention (SDPA over contiguous KV): it "
                                 f"cannot be combined with attention_backend={selected!r} (leave it 'auto').")
            return [VIRTUAL_CONTIGUOUS]
        if batch_invariant:
            if selected == "torch":
                raise ValueError("batch_invariant=True needs attention_backend auto or cpu, not torch.")
            return [CPU_INVARIANT]
        if selected == "auto":
            return [self.attention_backends[name] for name in self.auto_attention_backends]
        if selected == "triton":  # no GPU to compile for: the interpreter (read when the kernels are defined)
            os.environ.setdefault("TRITON_INTERPRET", "1")
        return [self.attention_backends[selected]]

    def kv_cache_memory_bytes(self, kv_cache_memory: int | str | None, gpu_memory_utilization: float | None) -> int:
        """`kv_cache_memory` (bytes or a size such as '2GiB'), else 2 GiB or a quarter of the available memory if
        that is smaller; `gpu_memory_utilization` is accepted (vLLM scripts pass it) and has no meaning here."""
        if gpu_memory_utilization is not None:
            _log_gpu_memory_utilization_ignored(gpu_memory_utilization)
        if kv_cache_memory is not None:
            return parse_size(kv_cache_memory)
        return int(min(DEFAULT_KV_CACHE_BYTES, available_memory_bytes() // 4))

    def set_up_process_env(self) -> None:
        """OpenMP threads sleep when idle, after a short spin.

        Threads that spin while waiting lose badly whenever anything else needs a core (the API server, a load
        generator, the tokenizer): measured 3-6x lower throughput on 2 cores. Sleep instead, but only after a short
        spin (GOMP_SPINCOUNT): a decode step runs ~200 parallel regions microseconds apart, and waking a sleeping
        thread for each cost 20% of a single-stream step. These must be set before torch loads its OpenMP runtime;
        the user's own settings win.
        """
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        os.environ.setdefault("GOMP_SPINCOUNT", "30000")

    def rank_cores(self, world_size: int, bind: str | None = None) -> list[list[int] | None]:
        """Each rank's share of the cores, or as $VLLM_CPU_OMP_THREADS_BIND / `bind` says (platforms/cpu_binding.py)."""
        return cpu_binding.rank_cores(world_size, bind)

    def pin_to_cores(self, cores: list[int] | None) -> int | None:
        """Pin this process to `cores` (where the OS allows it)."""
        return cpu_binding.pin_to_cores(cores)


@functools.cache
def _log_gpu_memory_utilization_ignored(value: float) -> None:
    """Say once per value that the CPU platform ignores gpu_memory_utilization."""
    logger.info("gpu_memory_utilization=%s has no meaning on the CPU platform: the KV cache is sized by "
                "kv_cache_memory.", value)
