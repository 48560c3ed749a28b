"""The `mp` executor: one spawned worker process per tensor x pipeline rank, joined in a gloo process group on
loopback (vLLM's `MultiprocExecutor`), started through the worker lifecycle (`collective_rpc` over the pipes).

Each step's SchedulerOutput is pickled once and written to every worker's pipe (by one writer thread, in order, so
a full pipe never blocks the engine while the driver waits to hand back an earlier step's output); the driver rank
(the last pipeline stage's first tensor-parallel rank) answers with the sampled tokens, which go to the other ranks
with the next step so that every worker's persistent batch holds the same tokens. With pipeline parallelism up to
one step per stage is in flight (`step_queue`). A worker that dies fails the step at once: the executor waits on
the driver's pipe and on every worker's process sentinel together, never on a collective.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import socket
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from typing import Any

from pagemill.config import EngineConfig
from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagemill.platforms import current_platform
from pagemill.worker.executor import WorkerGroupExecutor
from pagemill.worker.step_queue import InFlightSteps
from pagemill.worker.worker_proc import run_worker

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 900.0  # loading a large checkpoint
_SHUTDOWN_GRACE_S = 2.0


class WorkerDiedError(RuntimeError):
    """A worker process ended while the engine was using it."""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (the process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(WorkerGroupExecutor):
    """tensor_parallel_size x pipeline_parallel_size worker processes, started, watched and stopped here."""

    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.pipeline_parallel_size = pc.pipeline_parallel_size
        self.driver_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        self.steps = InFlightSteps()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagemill-send")
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        for rank, cores in enumerate(current_platform.rank_cores(self.world_size)):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=run_worker, args=(config, rank, init_method, child_conn, cores),
                               name=f"pagemill-worker-{rank}", daemon=True)
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns, self._writer)
        self._dead: str | None = None
        try:
            self.kv_cache_config = self._init_workers(_START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d workers ready (tensor_parallel_size=%d, pipeline_parallel_size=%d)", self.world_size,
                    pc.tensor_parallel_size, pc.pipeline_parallel_size)

    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        """worker.method(*args) on every rank (after the steps in flight), results in rank order; a worker's error
        is raised here (ValueError stays ValueError) and ends that worker."""
        self.steps.drain()  # the driver's pending step outputs come first on its pipe
        self._broadcast(("rpc", method, args))
        return [self._rpc_reply(rank, timeout) for rank in range(self.world_size)]

    def _rpc_reply(self, rank: int, timeout: float | None) -> Any:
        reply = self._recv(rank, timeout, rpc=True)
        if reply[0] == "error":
            _, kind, message = reply
            raise (ValueError if kind == "ValueError" else RuntimeError)(f"worker rank {rank}: {message}")
        return reply[1]

    def _recv(self, rank: int, timeout: float | None = None, rpc: bool = False) -> Any:
        """The next reply of worker `rank`; WorkerDiedError as soon as any worker's process ends first."""
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        conn = self.conns[rank]
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while True:
            ready = wait([conn, *sentinels], timeout)
            if conn in ready and conn.poll():
                try:
                    return conn.recv()
                except EOFError:
                    pass
            if not ready:
                raise WorkerDiedError(f"worker rank {rank} did not answer within {timeout:.0f} s")
            dead = [r for s, r in sentinels.items() if s in ready] or [rank]
            proc = self.procs[dead[0]]
            proc.join(0.1)
            if rpc and conn.poll():  # an rpc's error message precedes the exit
                return conn.recv()
            self._dead = (f"worker rank {dead[0]} (pid {proc.pid}) died with exit code {proc.exitcode}; "
                          "the engine cannot continue.")
            logger.error(self._dead)
            self.shutdown()
            raise WorkerDiedError(self._dead)

    def _broadcast(self, msg: tuple) -> None:
        """Queue `msg` for every worker (pickled here, written in order by the writer thread; a worker that died
        meanwhile is seen by the next _recv)."""
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        self._writer.submit(_write_all, self.conns, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_step(self, scheduler_output: SchedulerOutput,
                   sampled: dict[str, list[int]]) -> Callable[[], ModelRunnerOutput]:
        """Queue the step for every rank; the driver rank's output is the next reply on its pipe."""
        self._broadcast(("execute_model", scheduler_output, sampled))
        return lambda: self._recv(self.driver_rank)

    def check_health(self) -> None:
        """Raise WorkerDiedError if any worker process has ended."""
        if self._dead is None:
            for rank, proc in enumerate(self.procs):
                if not proc.is_alive():
                    self._dead = f"worker rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}."
                    self.shutdown()
                    break
        if self._dead is not None:
            raise WorkerDiedError(self._dead)

    def shutdown(self) -> None:
        """Ask every worker to stop, then terminate (and kill) the ones that do not (e.g. stuck in a collective
        whose peer died)."""
        self._finalizer()


def _write_all(conns: list[Connection], data: bytes) -> None:
    for conn in conns:
        try:
            conn.send_bytes(data)
        except OSError:  # that worker is gone (its sentinel tells the reader) or the executor is shutting down
            pass


def _stop_workers(procs: list[multiprocessing.process.BaseProcess], conns: list[Connection],
                  writer: ThreadPoolExecutor) -> None:
    data = pickle.dumps(("shutdown",))
    live = [conn for proc, conn in zip(procs, conns) if proc.is_alive()]
    try:  # after the steps already queued, through the writer (two writers would interleave their bytes)
        writer.submit(_write_all, live, data)
    except RuntimeError:  # the interpreter is exiting: the writer takes no more work
        _write_all(live, data)
    writer.shutdown(wait=False)
    for proc in procs:
        proc.join(_SHUTDOWN_GRACE_S / max(1, len(procs)))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    for conn in conns:
        conn.close()
