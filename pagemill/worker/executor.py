"""Executors: what runs the model for the engine core, behind one interface (vLLM's `Executor`): one worker in
the engine's own process (`uni`), one worker process per tensor / pipeline rank (`mp`), or one Ray actor per rank
(`ray`, across the nodes of a Ray cluster). Each reaches its workers through `collective_rpc` and starts them the same
way (`_init_workers`: the worker lifecycle of worker_base.py)."""

from __future__ import annotations

import dataclasses
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
from pagemill.worker.launched_step import LaunchedStep
from pagemill.worker.step_queue import InFlightSteps, StepFuture
from pagemill.worker.worker_base import WorkerBase, worker_class


def merge_kv_cache_configs(configs: list[KVCacheConfig]) -> KVCacheConfig:
    """The KV cache the engine schedules over, from every rank's: every rank indexes the same block ids, so the
    fewest blocks (and swap blocks)."""
    if len({c.group_windows for c in configs}) > 1:
        raise ValueError("pipeline_parallel_size: the stages' layers fall into different KV cache groups "
                         "(sliding-window layers); this model does not split into these stages.")
    return dataclasses.replace(configs[0], num_blocks=min(c.num_blocks for c in configs),
                               num_swap_blocks=min(c.num_swap_blocks for c in configs))


class Executor(ABC):
    """The engine core's view of its workers: start them (in __init__), run a step, check and stop them."""

    kv_cache_config: KVCacheConfig  # the KV cache every worker allocated (blocks, swap blocks, block size)
    _step_thread: ThreadPoolExecutor | None = None  # async scheduling: runs the steps, one at a time, in order

    @property
    def launches_steps(self) -> bool:
        """Whether async steps are launched from the engine's thread (the worker queues device work and returns)
        rather than run in a step thread."""
        return False

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps may be in flight at once: the engine core keeps a batch queue when more than one."""
        return 1

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        """worker.method(*args) on every worker, results in rank order (vLLM's `collective_rpc`); `timeout`: seconds
        to wait for all of them (None: no limit)."""

    def _init_workers(self, timeout: float | None = None) -> KVCacheConfig:
        """Start every worker through the lifecycle, in the same order whatever the executor: set up the device, load
        the model, size the KV cache (the fewest blocks over ranks, so that every rank indexes the same ids) and
        allocate it; returns the KV cache the engine core schedules over."""
        self.collective_rpc("init_device", timeout=timeout)
        self.collective_rpc("load_model", timeout=timeout)
        num_blocks = min(self.collective_rpc("determine_num_available_blocks", timeout=timeout))
        return merge_kv_cache_configs(self.collective_rpc("initialize_cache", (num_blocks,), timeout=timeout))

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | StepFuture:
        """Run one step on the workers; the sampled tokens (and the runner's section timings) come back, or with
        `non_block` a future of them (vLLM's interface)."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput] | LaunchedStep:
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
        self.driver_worker: WorkerBase = worker_class(config)(config)  # the platform's worker
        self.kv_cache_config = self._init_workers()

    @property
    def model_runner(self) -> Any:
        """The worker's model runner (tests and benchmarks inspect it)."""
        return self.driver_worker.model_runner

    @property
    def launches_steps(self) -> bool:
        """The worker's: whether it queues a step on its device and returns (the GPU worker)."""
        return self.driver_worker.launches_steps

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput] | LaunchedStep:
        """The worker's launch_model where it launches steps (the GPU worker), else the base's step thread."""
        if self.launches_steps:
            return self.driver_worker.launch_model(scheduler_output)
        return super().execute_model_async(scheduler_output)

    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        """worker.method(*args) on the one worker."""
        return [getattr(self.driver_worker, method)(*args)]

    def apply_model(self, func: Callable[[nn.Module], Any]) -> list[Any]:
        """func(model) on each worker's model, results in worker order."""
        return [self.driver_worker.apply_model(func)]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on every worker; True if it was not loaded yet."""
        return self.driver_worker.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter from every worker."""
        return self.driver_worker.remove_lora(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        """Pin an adapter on every worker."""
        return self.driver_worker.pin_lora(lora_id)

    def list_loras(self) -> list[int]:
        """Ids of the adapters loaded (on the first worker)."""
        return self.driver_worker.list_loras()

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | StepFuture:
        """Run one step on the worker; the runner's section timings come back in the output (with `non_block`: a
        future that is already done)."""
        out = self.driver_worker.execute_model(scheduler_output)
        return StepFuture.completed(out) if non_block else out

    def shutdown(self) -> None:
        """Release what the worker holds beyond memory (a KV connector's sockets and threads)."""
        self.driver_worker.shutdown()


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

    def apply_model(self, func: Callable[[nn.Module], Any]) -> list[Any]:
        """func(model) on every rank's model (func must pickle: a module-level function), in rank order."""
        return self.collective_rpc("apply_model", (func,))

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
