"""Executor: runs the model runner for the engine core (one in-process worker on a CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from pagemill.config import EngineConfig
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagemill.lora.request import LoRARequest
from pagemill.worker.pooling_runner import make_model_runner


class UniProcExecutor:
    """A single worker in the engine core's own process."""

    def __init__(self, config: EngineConfig) -> None:
        self.model_runner = make_model_runner(config)  # generate, or a pooling model's runner

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        """The KV cache the worker allocated (blocks, swap blocks, block size)."""
        return self.model_runner.kv_cache_config

    def apply_model(self, func: Callable[[nn.Module], Any]) -> list[Any]:
        """func(model) on each worker's model, results in worker order."""
        return [func(self.model_runner.model)]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on every worker; True if it was not loaded yet."""
        return self.model_runner.lora_manager.add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter from every worker."""
        return self.model_runner.lora_manager.remove_adapter(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        """Pin an adapter on every worker."""
        return self.model_runner.lora_manager.pin_adapter(lora_id)

    def list_loras(self) -> list[int]:
        """Ids of the adapters loaded (on the first worker)."""
        return self.model_runner.lora_manager.list_adapters()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on the worker; the runner's section timings come back in the output."""
        return self.model_runner.execute_model(scheduler_output)
