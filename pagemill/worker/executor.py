"""Executors: what runs the model for the engine core, behind one interface (vLLM's `Executor`): one worker in
the engine's own process (`uni`), one worker process per tensor / pipeline rank (`mp`), or one Ray actor per rank
(`ray`, across the nodes of a Ray cluster)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from pagemill.config import EngineConfig
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagemill.lora.request import LoRARequest
from pagemill.platforms import current_platform
from pagemill.utils.import_utils import resolve_obj_by_qualname
from pagemill.worker.step_queue import InFlightSteps, StepFuture


class Executor(ABC):
    """The engine core's view of its workers: start them (in __init__), run a step, check and stop them."""

    kv_cache_config: KVCacheConfig  # the KV cache every worker allocated (blocks, swap blocks, block size)
    _step_thread: ThreadPoolExecutor | None = None  # async scheduling: runs the steps, one at a time, in order

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps may be in flight at once: the engine core keeps a batch queue when more than one."""
        return 1

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | StepFuture:
        """Run one step on the workers; the sampled tokens (and the runner's section timings) come back, or with
        `non_block` a future of them (vLLM's interface)."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start a step and return at once (async scheduling): the steps run one after the other, in submission
        order, in the executor's step thread (the forward in this process for `uni`, a wait on the worker process or
        actor for `mp` / `ray`), so the engine can schedule the next step meanwhile."""
        if self._step_thread is None:
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="pagemill-step")
        return self._step_thread.submit(self.execute_model, scheduler_output)

    def stop_step_thread(self) -> None:
        """End the async-scheduling step thread (after the steps submitted so far)."""
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
            self._step_thread = None

    @abstractmethod
    def apply_model(self, func: Callable[[nn.Module], Any]) -> list[Any]:
        """func(model) on each worker's model, results in rank order."""

    @abstractmethod
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on every worker; True if it was not loaded yet."""

    @abstractmethod
    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter from every worker."""

    @abstractmethod
    def pin_lora(self, lora_id: int) -> bool:
        """Pin an adapter on every worker."""

    @abstractmethod
    def list_loras(self) -> list[int]:
        """Ids of the adapters loaded (on the first worker)."""

    def check_health(self) -> None:
        """Raise if a worker is dead (an in-process worker is alive while the engine is)."""

    def shutdown(self) -> None:
        """Stop the workers (nothing to stop in-process)."""


class UniProcExecutor(Executor):
    """A single worker in the engine core's own process."""

    def __init__(self, config: EngineConfig) -> None:
        # the platform's runner factory: generate, or a pooling model's runner
        self.model_runner = resolve_obj_by_qualname(current_platform.model_runner_factory)(config)

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

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | StepFuture:
        """Run one step on the worker; the runner's section timings come back in the output (with `non_block`: a
        future that is already done)."""
        out = self.model_runner.execute_model(scheduler_output)
        return StepFuture.completed(out) if non_block else out

    def shutdown(self) -> None:
        """Release the runner's KV connector (its sockets and threads), if it has one."""
        connector = getattr(self.model_runner, "kv_connector", None)
        if connector is not None:
            connector.shutdown()


class ResolvedGrammar:
    """A step's structured-output bitmask, already filled (the background fill lives in the engine process)."""

    def __init__(self, grammar: Any) -> None:
        self._bitmask: torch.Tensor = grammar.bitmask()
        self.req_ids, self.offsets, self.fill_seconds = grammar.req_ids, grammar.offsets, grammar.fill_seconds

    def bitmask(self) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32, as GrammarStep.bitmask."""
        return self._bitmask


class WorkerGroupExecutor(Executor):
    """Base of the executors with worker processes or actors (mp, ray): steps go to every rank and the driver
    rank's output comes back, up to one step per pipeline stage in flight. LoRA is refused there (config check), so
    the adapter calls only keep the interface."""

    pipeline_parallel_size: int
    steps: InFlightSteps

    @property
    def max_concurrent_batches(self) -> int:
        """One micro-batch per pipeline stage (vLLM)."""
        return self.pipeline_parallel_size

    @abstractmethod
    def _send_step(self, scheduler_output: SchedulerOutput,
                   sampled: dict[str, list[int]]) -> Callable[[], ModelRunnerOutput]:
        """Start the step on every rank, with the engine's tokens the other ranks lack; returns what waits for the
        driver rank's output."""

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | StepFuture:
        """Send the step to every rank; the driver rank's output, or with `non_block` its future."""
        if scheduler_output.grammar is not None:
            scheduler_output.grammar = ResolvedGrammar(scheduler_output.grammar)
        future = self.steps.submit(lambda sampled: self._send_step(scheduler_output, sampled))
        return future if non_block else future.result()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """LoRA is refused with several ranks (config check); kept for the interface."""
        raise ValueError("enable_lora: LoRA adapters do not run with worker processes yet.")

    def remove_lora(self, lora_id: int) -> bool:
        """No adapters are ever loaded here."""
        return False

    def pin_lora(self, lora_id: int) -> bool:
        """No adapters are ever loaded here."""
        raise ValueError("enable_lora: LoRA adapters do not run with worker processes yet.")

    def list_loras(self) -> list[int]:
        """No adapters are ever loaded here."""
        return []
