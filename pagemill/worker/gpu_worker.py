"""The GPU worker (vLLM's `Worker` for CUDA): one rank's device, its GpuModelRunner, its KV cache sized from
`gpu_memory_utilization` after a profiled forward (vLLM's rule), or from `kv_cache_memory` when given.

Device-generic like its runner: with config.device_config.device == "cpu" (worker_cls=...GpuWorker,
attention_backend="triton") the whole step runs on the CPU through Triton's interpreter, which is how CI runs it;
only device == "cuda" touches torch.cuda.
"""

from __future__ import annotations

import logging
import time

import torch

from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import SchedulerOutput
from pagemill.distributed.parallel_state import ParallelContext, init_distributed
from pagemill.platforms import current_platform
from pagemill.worker.cpu_worker import CpuWorker
from pagemill.worker.gpu_model_runner import GpuModelRunner, kv_cache_bytes_from_profile, log_kv_sizing
from pagemill.worker.launched_step import LaunchedStep

logger = logging.getLogger(__name__)


class GpuWorker(CpuWorker):
    """A rank on one GPU (or, for tests, the CPU): the GPU runner driven through WorkerBase's lifecycle."""

    model_runner: GpuModelRunner
    launches_steps = True  # async scheduling launches a step behind the one in flight (one thread)

    @property
    def is_cuda(self) -> bool:
        """Whether this rank runs on a CUDA GPU."""
        return self.config.device_config.device == "cuda"

    def init_device(self) -> None:
        """CUDA: this rank's GPU (rank modulo the visible devices), NCCL process group; CPU: as the CPU worker."""
        if not self.is_cuda:
            return super().init_device()
        torch.cuda.set_device(self.rank % torch.cuda.device_count())
        self.num_threads = current_platform.init_threads(self.config.num_threads)
        if self.distributed_init_method is None:
            self.parallel = ParallelContext()
        else:
            pc = self.config.parallel_config
            self.parallel = init_distributed(self.rank, pc.tensor_parallel_size, pc.pipeline_parallel_size,
                                             self.distributed_init_method)
        self._is_driver = self.parallel.is_driver

    def load_model(self) -> None:
        """The GPU runner (generating models; paged KV, or virtual ranges) and its model."""
        if self.config.model_config.runner_type != "generate":
            raise ValueError("runner='pooling' is not available on the GPU worker yet.")
        if self.config.cache_config.kv_cache_layout == "virtual":
            from pagemill.worker.gpu_virtual_kv_runner import GpuVirtualKVModelRunner

            self.model_runner = GpuVirtualKVModelRunner(self.config, self.parallel)
        else:
            self.model_runner = GpuModelRunner(self.config, self.parallel)
        self.model_runner.load_model()

    def launch_model(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Queue one step on the device; its tokens reach the host in the returned step's `result()`."""
        return self.model_runner.launch_model(scheduler_output)

    def determine_num_available_blocks(self) -> int:
        """`num_gpu_blocks_override`, else `kv_cache_memory` when given (the CPU worker's rule), else (CUDA) what
        gpu_memory_utilization leaves after a profiled forward at max_num_batched_tokens."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override or cc.kv_cache_memory or not self.is_cuda:
            return super().determine_num_available_blocks()
        start = time.perf_counter()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        kv_tmp = self.model_runner.profile_run()
        torch.cuda.synchronize()
        torch_peak = torch.cuda.max_memory_allocated() - kv_tmp
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        non_torch = max(0, total - free - torch.cuda.memory_reserved())
        kv_bytes = kv_cache_bytes_from_profile(total, cc.gpu_memory_utilization or 0.9, torch_peak, non_torch)
        log_kv_sizing(total, cc.gpu_memory_utilization or 0.9, torch_peak, non_torch, kv_bytes,
                      time.perf_counter() - start)
        per_block = self.model_runner.kv_block_bytes()
        return self.model_runner.cap_num_blocks(int(max(2, kv_bytes // per_block)))

    def initialize_cache(self, num_blocks: int) -> KVCacheConfig:
        """Allocate the KV cache on the device (and capture the decode graphs, CUDA)."""
        if not self.is_cuda:
            return super().initialize_cache(num_blocks)
        self.kv_cache_config = self.model_runner.initialize_kv_cache(num_blocks)
        return self.kv_cache_config
