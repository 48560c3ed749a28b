"""The `ray` executor: one Ray actor per tensor x pipeline rank, placed with a placement group on the nodes of the
Ray cluster this process is connected to (or a local one it starts), joined in a gloo process group (vLLM's
`RayDistributedExecutor`), started through the worker lifecycle (`collective_rpc` as remote calls).

Steps reach every actor as remote calls (an actor runs its calls in submission order, so with pipeline parallelism
one step per stage is in flight); the driver rank's result is the step's output. A dead actor fails the step at
once: the executor waits on every rank's call, so a rank that died while the others sit in a collective is seen.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from pagemill.config import EngineConfig
from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagemill.worker.executor import WorkerGroupExecutor
from pagemill.worker.multiproc_executor import WorkerDiedError
from pagemill.worker.step_queue import InFlightSteps

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 900.0
_PLACEMENT_TIMEOUT_S = 60.0


def bind_gloo_to(ip: str) -> None:
    """Make gloo use the network interface that holds `ip` (the address Ray advertises for this node), unless
    GLOO_SOCKET_IFNAME says otherwise: by default gloo binds to what the hostname resolves to, often loopback, which
    the ranks on other nodes cannot reach."""
    import psutil  # Ray ships it (ray/thirdparty_files, on the path once ray is imported)

    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return
    logger.warning("No network interface holds this node's address %s; gloo picks its own.", ip)


class RayWorkerWrapper:
    """One rank inside a Ray actor (vLLM's `RayWorkerWrapper`): builds the platform's worker and runs its methods."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config, self.rank = config, rank
        self.worker: Any = None

    def rendezvous_address(self) -> str:
        """tcp://<this node's address>:<a free port> (asked of rank 0, which hosts the process group's store)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return f"tcp://{ip}:{s.getsockname()[1]}"

    def init_worker(self, init_method: str) -> None:
        """Build this rank's worker (gloo on the interface Ray advertises); the lifecycle's calls follow."""
        import ray

        from pagemill.worker.worker_base import worker_class

        bind_gloo_to(ray.util.get_node_ip_address())
        self.worker = worker_class(self.config)(self.config, self.rank, init_method, None)

    def execute_method(self, method: str, *args: Any) -> Any:
        """worker.method(*args) (the executor's collective_rpc)."""
        return getattr(self.worker, method)(*args)

    def execute_model(self, scheduler_output: SchedulerOutput, sampled: dict[str, list[int]]) -> Any:
        """One step; the output on the driver rank, None elsewhere."""
        return self.worker.execute_model(scheduler_output, sampled)

    def ping(self) -> bool:
        """The health check's call."""
        return True


class RayDistributedExecutor(WorkerGroupExecutor):
    """tensor_parallel_size x pipeline_parallel_size Ray actors, one bundle of `num_threads` CPUs each."""

    def __init__(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():  # an existing cluster ($RAY_ADDRESS or `ray start` here), else a local one
            ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=True)
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.pipeline_parallel_size = pc.pipeline_parallel_size
        self.driver_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        self.steps = InFlightSteps()
        cpus = config.num_threads or 1
        config = dataclasses.replace(config, num_threads=cpus)  # each rank's threads: its bundle's CPUs
        self.placement_group = placement_group([{"CPU": cpus}] * self.world_size, strategy="PACK")
        self.workers: list[Any] = []
        self._dead: str | None = None
        try:
            ready, _ = ray.wait([self.placement_group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ValueError(f"tensor_parallel_size x pipeline_parallel_size: the Ray cluster has no room for "
                                 f"{self.world_size} workers of {cpus} CPU(s) each (num_threads) "
                                 f"({ray.cluster_resources().get('CPU', 0):.0f} CPUs in all).")
            actor = ray.remote(num_cpus=cpus)(RayWorkerWrapper)
            self.workers = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=rank)).remote(config, rank)
                for rank in range(self.world_size)]
            init_method = ray.get(self.workers[0].rendezvous_address.remote())
            self._get_all([w.init_worker.remote(init_method) for w in self.workers], _START_TIMEOUT_S)
            self.kv_cache_config = self._init_workers(_START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d Ray workers ready (tensor_parallel_size=%d, pipeline_parallel_size=%d)", self.world_size,
                    pc.tensor_parallel_size, pc.pipeline_parallel_size)

    def _get_all(self, refs: list[Any], timeout: float | None = None) -> list[Any]:
        """Every call's result; WorkerDiedError as soon as one rank's call fails (its actor died)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
                if not done:
                    raise WorkerDiedError(f"Ray workers did not answer within {timeout:.0f} s")
                ray.get(done[0])  # raises if that rank failed
            return ray.get(refs)
        except (RayActorError, RayTaskError) as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, ValueError):  # a configuration error while loading: the user's to fix
                self.shutdown()
                raise ValueError(str(cause)) from None
            self._dead = f"a Ray worker failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            logger.error(self._dead)
            self.shutdown()
            raise WorkerDiedError(self._dead) from e

    def _send_step(self, scheduler_output: SchedulerOutput,
                   sampled: dict[str, list[int]]) -> Callable[[], ModelRunnerOutput]:
        """Every rank's call; what waits for them all and returns the driver rank's output."""
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        refs = [w.execute_model.remote(scheduler_output, sampled) for w in self.workers]
        return lambda: self._get_all(refs)[self.driver_rank]

    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        """worker.method(*args) on every rank's actor, results in rank order."""
        return self._get_all([w.execute_method.remote(method, *args) for w in self.workers], timeout)

    def check_health(self) -> None:
        """Raise WorkerDiedError if an actor is gone (a ping to each; called while the engine is idle)."""
        if self._dead is None and self.workers:
            self._get_all([w.ping.remote() for w in self.workers], timeout=30.0)
        if self._dead is not None:
            raise WorkerDiedError(self._dead)

    def shutdown(self) -> None:
        """Kill the actors and free their placement group (the Ray session itself is left as it was)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        workers, self.workers = self.workers, []
        for w in workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        pg, self.placement_group = getattr(self, "placement_group", None), None
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
