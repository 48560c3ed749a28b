"""The worker interface (vLLM's `WorkerBase`): one rank's device, model runner and KV cache, driven by an executor
through one lifecycle, whatever the executor (uni, mp, ray) and whatever the device:

    worker = worker_class(config)(config, rank, distributed_init_method, cores)
    worker.init_device()                       # threads, core binding, this rank's process group
    worker.load_model()                        # the model runner and its model (weights, LoRA slots, head screen)
    n = worker.determine_num_available_blocks()  # KV blocks that fit the device's KV memory (the executor takes
    worker.initialize_cache(min over ranks)    # the fewest over ranks) -> allocate them; returns the KVCacheConfig
    worker.execute_model(scheduler_output)     # every step: a SchedulerOutput in, a ModelRunnerOutput out

`LIFECYCLE` names these start-up steps in order; `Executor._init_workers` runs them (tests/worker checks the order).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pagemill.config import EngineConfig
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagemill.lora.request import LoRARequest
from pagemill.platforms import current_platform
from pagemill.utils.import_utils import resolve_obj_by_qualname
from pagemill.worker.launched_step import LaunchedStep

# The start-up steps every executor runs on every worker, in this order (the third's result sets the fourth's).
LIFECYCLE = ("init_device", "load_model", "determine_num_available_blocks", "initialize_cache")


class WorkerBase(ABC):
    """One rank: sets up its device, owns its model runner, sizes and allocates its KV cache, runs steps."""

    kv_cache_config: KVCacheConfig  # set by initialize_cache
    # Whether `launch_model` queues a step without waiting for its tokens (async scheduling with no step thread).
    launches_steps: bool = False

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None,
                 cores: list[int] | None = None) -> None:
        # `distributed_init_method`: the process group's rendezvous (None: a single in-process worker);
        # `cores`: the CPU cores to pin this process to (None: not pinned).
        self.config = config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.cores = cores

    # ---- lifecycle ----
    @abstractmethod
    def init_device(self) -> None:
        """Set up this rank's device: threads, core binding, process group (before anything is loaded)."""

    @abstractmethod
    def load_model(self) -> None:
        """Build the model runner and load its model."""

    @abstractmethod
    def determine_num_available_blocks(self) -> int:
        """How many KV cache blocks fit this rank's KV memory (the executor allocates the fewest over ranks)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> KVCacheConfig:
        """Allocate `num_blocks` KV blocks (plus swap space) and bind them to the model; the resulting cache."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput,
                      sampled: dict[str, list[int]] | None = None) -> ModelRunnerOutput | None:
        """One step. `sampled`: the engine's tokens of the previous step, for a rank that did not sample them itself
        (tensor / pipeline parallelism). The output on the driver rank, None on the others."""

    def launch_model(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Queue one step and return before its tokens are on the host (workers with `launches_steps`)."""
        raise NotImplementedError(f"{type(self).__name__} does not launch steps without waiting for them")

    # ---- what the executors and the engine core call between steps ----
    @property
    @abstractmethod
    def is_driver_worker(self) -> bool:
        """Whether this rank's step output is the engine's (the last pipeline stage's first tensor-parallel rank)."""

    @property
    @abstractmethod
    def model(self) -> Any:
        """The loaded model (an nn.Module)."""

    def apply_model(self, func: Callable[[Any], Any]) -> Any:
        """func(model) on this rank (vLLM's `LLM.apply_model`)."""
        return func(self.model)

    @abstractmethod
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter; True if it was not loaded yet."""

    @abstractmethod
    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; True if it was loaded."""

    @abstractmethod
    def pin_lora(self, lora_id: int) -> bool:
        """Keep an adapter loaded whatever the LRU says."""

    @abstractmethod
    def list_loras(self) -> list[int]:
        """Ids of the adapters loaded."""

    def shutdown(self) -> None:
        """Release what the worker holds beyond its memory (sockets, threads)."""


def worker_class(config: EngineConfig | None = None) -> type[WorkerBase]:
    """The worker class the engine's `device_config.worker_cls` names, else the one the current platform names
    (`Platform.worker_cls`)."""
    name = config.device_config.worker_cls if config is not None else "auto"
    return resolve_obj_by_qualname(current_platform.worker_cls if name in ("auto", None, "") else name)
