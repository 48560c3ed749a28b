"""One worker process of the `mp` executor: a model runner for one tensor / pipeline rank, driven over a pipe.

Messages executor -> worker (pickled): ("execute_model", scheduler_output, previous step's sampled tokens)
| ("apply_model", func) | ("shutdown",). Worker -> executor: ("ready", kv_cache_config) | ("error", type, message)
at start-up; the step's ModelRunnerOutput from the driver rank only; ("ok", result) for apply_model. A worker
that fails after start-up logs the traceback and exits: the executor sees its process end.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pagemill.config import EngineConfig

if TYPE_CHECKING:
    from pagemill.distributed.parallel_state import ParallelContext
    from pagemill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 1.0  # how often an idle worker checks that the engine process is still there


def run_worker(config: EngineConfig, rank: int, init_method: str, conn: Connection,
               cores: list[int] | None) -> None:
    """Process entry point (multiprocessing spawn target): pin, join the process group, load, serve steps."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s [worker rank {rank}] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the engine decides
    parent = os.getppid()
    try:
        runner, parallel = start_worker(config, rank, init_method, cores)
    except BaseException as e:
        logger.error("Worker failed to start:\n%s", traceback.format_exc())
        conn.send(("error", type(e).__name__, str(e)))
        sys.exit(1)
    conn.send(("ready", runner.kv_cache_config))
    try:
        _serve(runner, parallel, conn, parent)
    except BaseException:
        logger.error("Worker died:\n%s", traceback.format_exc())
        sys.exit(1)


def start_worker(config: EngineConfig, rank: int, init_method: str,
                 cores: list[int] | None) -> tuple[ModelRunner, ParallelContext]:
    """Pin this process to `cores`, join the process group of all ranks, build this rank's model runner."""
    from pagemill.distributed.parallel_state import init_distributed
    from pagemill.platforms import current_platform
    from pagemill.utils.import_utils import resolve_obj_by_qualname

    threads = current_platform.pin_to_cores(cores)
    pc = config.parallel_config
    num_threads = current_platform.init_threads(
        config.num_threads or threads or max(1, (os.cpu_count() or 1) // pc.world_size))
    parallel = init_distributed(rank, pc.tensor_parallel_size, pc.pipeline_parallel_size, init_method)
    make_runner = resolve_obj_by_qualname(current_platform.model_runner_factory)
    runner = make_runner(dataclasses.replace(config, num_threads=num_threads), parallel)
    logger.info("Ready: tp rank %d/%d, pp rank %d/%d, %d threads on cores %s", parallel.tp_rank, parallel.tp_size,
                parallel.pp_rank, parallel.pp_size, num_threads, cores)
    return runner, parallel


def execute_step(runner: ModelRunner, parallel: ParallelContext, scheduler_output: Any,
                 sampled: dict[str, list[int]]) -> Any:
    """One step on this rank: the engine's previous tokens first (where this rank's own are not the engine's), then
    the forward; the output on the driver rank, None on the others."""
    if sampled and not parallel.is_driver:
        runner.apply_sampled(sampled, appended=parallel.is_last_stage)
    out = runner.execute_model(scheduler_output)
    return out if parallel.is_driver else None


def _serve(runner: Any, parallel: Any, conn: Connection, parent: int) -> None:
    """The worker's loop: one message, one action, until shutdown (or the engine process is gone)."""
    driver = parallel.is_driver
    while True:
        if not conn.poll(_PARENT_POLL_S):
            if os.getppid() != parent:
                logger.warning("Engine process is gone; worker exits.")
                return
            continue
        msg = pickle.loads(conn.recv_bytes())
        kind = msg[0]
        if kind == "execute_model":
            out = execute_step(runner, parallel, msg[1], msg[2])
            if driver:
                conn.send(out)
        elif kind == "apply_model":
            conn.send(("ok", msg[1](runner.model)))
        elif kind == "shutdown":
            return
        else:
            raise RuntimeError(f"unknown message {kind!r}")
