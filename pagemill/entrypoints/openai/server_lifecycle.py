"""How `pagemill serve` stops: a graceful drain on SIGTERM/SIGINT, an immediate exit on a second signal, and a
non-zero exit once the engine core died (so that a supervisor restarts the server)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Generator
from types import FrameType

import uvicorn

from pagemill.engine.async_llm import AsyncLLM
from pagemill.engine.core_client import EngineDeadError

logger = logging.getLogger("pagemill.entrypoints.openai.server_lifecycle")

# Seconds after the drain deadline for the handlers to send the errors of the requests ended by the shutdown.
_ANSWER_GRACE_S = 5.0


class ServerShuttingDownError(EngineDeadError):
    """The error of a request still running when the shutdown timeout ran out (a 503)."""

    status = 503


class GracefulServer(uvicorn.Server):
    """uvicorn's server that, on the first SIGTERM/SIGINT, stops accepting, lets requests in flight finish for up
    to `shutdown_timeout_s`, then ends the rest with a well-formed error and exits 0; a second signal exits at once.
    When the engine core dies it answers the requests in flight (they fail) and exits with code 1."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        config.timeout_graceful_shutdown = shutdown_timeout_s + _ANSWER_GRACE_S  # the last resort: cancel tasks
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.exit_code = 0
        engine.add_dead_callback(self._on_engine_dead)

    def _on_engine_dead(self) -> None:
        logger.error("The engine core died: answering the requests in flight, then exiting.")
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain; second: exit now."""
        if self.should_exit:
            logger.warning("Second signal: exiting without waiting for the requests in flight.")
            self.force_exit = True
        else:
            logger.info("Shutting down: no new connections; %d request(s) in flight get up to %g s to finish "
                        "(--shutdown-timeout).", self.engine.num_requests_in_flight, self.shutdown_timeout_s)
            self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's signal capture, without re-raising the signal afterwards: a drained server exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, with the requests still running at the deadline ended by an error."""
        deadline = asyncio.get_running_loop().create_task(self._end_requests_after(self.shutdown_timeout_s))
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _end_requests_after(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        n = self.engine.abort_all(ServerShuttingDownError(
            f"The server is shutting down: the request did not finish within the shutdown timeout ({timeout_s:g} s)."))
        if n:
            logger.warning("Shutdown timeout: ended %d request(s) still in flight with an error.", n)
