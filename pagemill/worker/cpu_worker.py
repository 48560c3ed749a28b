"""The CPU worker (vLLM's `CPUWorker`): one rank's threads and core binding, its model runner (generate, virtual KV,
decoder or encoder pooling: pooling_runner.make_model_runner), its KV cache sized from `kv_cache_memory`."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagemill.distributed.parallel_state import ParallelContext, init_distributed
from pagemill.lora.request import LoRARequest
from pagemill.platforms import current_platform
from pagemill.utils.memory import keep_step_buffers_mapped
from pagemill.worker.pooling_runner import make_model_runner
from pagemill.worker.worker_base import WorkerBase

logger = logging.getLogger(__name__)


class CpuWorker(WorkerBase):
    """A rank on the host's cores: the model runner the model needs, driven through WorkerBase's lifecycle."""

    model_runner: Any  # ModelRunner, VirtualKVModelRunner, DecoderPoolingRunner or EncoderModelRunner
    parallel: ParallelContext

    def init_device(self) -> None:
        """Pin to this rank's cores, set the torch threads, join the process group of all ranks (if several)."""
        config = self.config
        threads = current_platform.pin_to_cores(self.cores)
        if self.distributed_init_method is None:  # the engine's own process: one rank
            self.num_threads = current_platform.init_threads(config.num_threads)
            self.parallel = ParallelContext()
        else:
            pc = config.parallel_config
            self.num_threads = current_platform.init_threads(
                config.num_threads or threads or max(1, (os.cpu_count() or 1) // pc.world_size))
            self.parallel = init_distributed(self.rank, pc.tensor_parallel_size, pc.pipeline_parallel_size,
                                             self.distributed_init_method)
            self.config = dataclasses.replace(config, num_threads=self.num_threads)
        self._is_driver = self.parallel.is_driver  # (read every step)

    def load_model(self) -> None:
        """Build the runner for the engine's model and load the model (this rank's share)."""
        self.model_runner = make_model_runner(self.config, self.parallel)
        self.model_runner.load_model()

    def determine_num_available_blocks(self) -> int:
        """`num_gpu_blocks_override`, else as many blocks as `kv_cache_memory` holds (at least 2; 1 for a model
        without a KV cache), within what the runner's KV layout can hold."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override:
            return cc.num_gpu_blocks_override
        per_block = self.model_runner.kv_block_bytes()
        if per_block == 0:
            return 1
        return self.model_runner.cap_num_blocks(int(max(2, cc.kv_cache_memory // per_block)))

    def initialize_cache(self, num_blocks: int) -> KVCacheConfig:
        """Allocate the KV cache (committed page by page as it is written) and everything that indexes it."""
        self.kv_cache_config = self.model_runner.initialize_kv_cache(num_blocks)
        keep_step_buffers_mapped()  # from here on (loading's one-off temporaries keep glibc's defaults)
        if self.distributed_init_method is not None:
            p = self.parallel
            logger.info("Ready: tp rank %d/%d, pp rank %d/%d, %d threads on cores %s", p.tp_rank, p.tp_size,
                        p.pp_rank, p.pp_size, self.num_threads, self.cores)
        return self.kv_cache_config

    def execute_model(self, scheduler_output: SchedulerOutput,
                      sampled: dict[str, list[int]] | None = None) -> ModelRunnerOutput | None:
        """One step: the engine's previous tokens first (where this rank's own are not the engine's), then the
        runner's step; its output on the driver rank, None on the others."""
        if sampled and not self._is_driver:
            self.model_runner.apply_sampled(sampled, appended=self.parallel.is_last_stage)
        out = self.model_runner.execute_model(scheduler_output)
        return out if self._is_driver else None

    @property
    def is_driver_worker(self) -> bool:
        """Whether this rank's step output is the engine's."""
        return self._is_driver

    @property
    def model(self) -> Any:
        """The runner's model."""
        return self.model_runner.model

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the runner's adapter slots; True if it was not loaded yet."""
        return self.model_runner.lora_manager.add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; True if it was loaded."""
        return self.model_runner.lora_manager.remove_adapter(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        """Keep an adapter loaded whatever the LRU says."""
        return self.model_runner.lora_manager.pin_adapter(lora_id)

    def list_loras(self) -> list[int]:
        """Ids of the adapters loaded."""
        return self.model_runner.lora_manager.list_adapters()

    def shutdown(self) -> None:
        """Release the runner's KV connector (its sockets and threads), if it has one."""
        connector = getattr(getattr(self, "model_runner", None), "kv_connector", None)
        if connector is not None:
            connector.shutdown()
