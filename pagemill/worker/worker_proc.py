"""One worker process of the `mp` executor: the platform's worker for one tensor / pipeline rank, driven over a pipe.

Messages executor -> worker (pickled): ("rpc", method, args) — the lifecycle's start-up steps, apply_model —
| ("execute_model", scheduler_output, previous step's sampled tokens) | ("shutdown",). Worker -> executor: ("ok",
result) | ("error", type, message) for an rpc; the step's ModelRunnerOutput from the driver rank only. A worker whose
rpc fails answers with the error and exits; one that fails in a step logs the traceback and exits: the executor sees
its process end.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from pagemill.config import EngineConfig
from pagemill.worker.worker_base import WorkerBase, worker_class

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 1.0  # how often an idle worker checks that the engine process is still there


def run_worker(config: EngineConfig, rank: int, init_method: str, conn: Connection,
               cores: list[int] | None) -> None:
    """Process entry point (multiprocessing spawn target): build the platform's worker, serve the executor's calls."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s [worker rank {rank}] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the engine decides
    parent = os.getppid()
    try:
        worker = worker_class(config)(config, rank, init_method, cores)
        _serve(worker, conn, parent)
    except SystemExit:
        raise
    except BaseException:
        logger.error("Worker died:\n%s", traceback.format_exc())
        sys.exit(1)
    worker.shutdown()


def _serve(worker: WorkerBase, conn: Connection, parent: int) -> None:
    """The worker's loop: one message, one action, until shutdown (or the engine process is gone)."""
    while True:
        if not conn.poll(_PARENT_POLL_S):
            if os.getppid() != parent:
                logger.warning("Engine process is gone; worker exits.")
                return
            continue
        msg = pickle.loads(conn.recv_bytes())
        kind = msg[0]
        if kind == "execute_model":
            out = worker.execute_model(msg[1], msg[2])
            if out is not None:  # the driver rank's
                conn.send(out)
        elif kind == "rpc":
            _, method, args = msg
            try:
                result = getattr(worker, method)(*args)
            except BaseException as e:
                logger.error("Worker failed in %s:\n%s", method, traceback.format_exc())
                conn.send(("error", type(e).__name__, str(e)))
                sys.exit(1)
            conn.send(("ok", result))
        elif kind == "shutdown":
            return
        else:
            raise RuntimeError(f"unknown message {kind!r}")
