"""Which executor runs the workers: the class `distributed_executor_backend` names (vLLM's `Executor.get_class`)."""

from __future__ import annotations

from pagemill.config import EngineConfig
from pagemill.worker.executor import Executor, UniProcExecutor


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor class for `config.parallel_config.distributed_executor_backend` (uni, mp or ray)."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "mp":
        from pagemill.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from pagemill.worker.ray_executor import RayDistributedExecutor

        return RayDistributedExecutor
    return UniProcExecutor
