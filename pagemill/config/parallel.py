"""ParallelConfig (tensor x pipeline ranks and what runs them) and DataParallelConfig (engine cores behind one
front end)."""

from __future__ import annotations

from dataclasses import dataclass

DP_ROUTING_POLICIES = ("prefix-affinity", "least-loaded")
DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class DataParallelConfig:
    """Data parallelism: N engine cores, each with its own scheduler and KV cache, behind one front end
    (routing: dp_routing, pagemill/engine/dp_router.py; imbalance_threshold: dp_imbalance_threshold)."""

    data_parallel_size: int = 1
    routing: str = "prefix-affinity"
    imbalance_threshold: int = 16

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}.")
        if self.routing not in DP_ROUTING_POLICIES:
            raise ValueError(f"dp_routing must be one of {', '.join(DP_ROUTING_POLICIES)}, got {self.routing!r}.")
        if self.imbalance_threshold < 0:
            raise ValueError(f"dp_imbalance_threshold must be >= 0, got {self.imbalance_threshold}.")


@dataclass
class ParallelConfig:
    """How the model is split over worker processes (vLLM's names): tensor x pipeline ranks, and what runs them."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # resolved: uni for one rank, else mp
    pipeline_micro_batching: bool = True  # PP > 1: one batch in flight per stage (False: one at a time)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not isinstance(self.pipeline_micro_batching, bool):
            raise ValueError(f"pipeline_micro_batching must be true or false, got {self.pipeline_micro_batching!r}.")
        backend = self.distributed_executor_backend
        if backend is None:
            self.distributed_executor_backend = backend = "uni" if self.world_size == 1 else "mp"
        if backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                             f"got {backend!r}.")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker; tensor_parallel_size x "
                             f"pipeline_parallel_size = {self.world_size} needs 'mp'.")

    @property
    def world_size(self) -> int:
        """Worker processes: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
