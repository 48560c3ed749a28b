"""Front-end side of the engine core process: spawn it, talk to it over ZMQ, notice when it dies."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagemill.config import EngineConfig

from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.engine import core_proc
from pagemill.engine.arg_utils import EngineArgs
from pagemill.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core process is gone: no request can be served any more."""


class EngineStartupError(RuntimeError):
    """The engine core process could not start (its message says why)."""


@dataclass
class CoreOutputBatch:
    """What one message from the core carries for the output handler."""

    outputs: EngineCoreOutputs
    errors: list[tuple[str, str]] = field(default_factory=list)  # (request_id, message) of rejected adds
    engine_index: int = 0  # which engine core sent it (data parallelism)


class EngineCoreClient:
    """Spawns the engine core process and exchanges msgpack frames with it (async output side)."""

    def __init__(self, config: EngineConfig | EngineArgs, engine_index: int | None = None,
                 cpus: list[int] | None = None) -> None:
        """Spawn the core with its configuration, or with the arguments it resolves its configuration from;
        `engine_index` and `cpus` (the cores to pin it to) for one engine of several (data parallelism)."""
        self._tmpdir = tempfile.mkdtemp(prefix="pagemill-zmq-")
        input_address, output_address = f"ipc://{self._tmpdir}/input", f"ipc://{self._tmpdir}/output"
        self.ctx = zmq.Context(1)
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(input_address)
        # The asyncio socket owns the output socket; the synchronous one (start-up) is a non-owning shadow of it.
        # (The other way round, the owner's finalizer would close a handle the shadow had already closed: by then
        # perhaps another client's socket.)
        self._output_socket = zmq.asyncio.Socket(self.ctx, zmq.PULL)
        self._output_socket.setsockopt(zmq.RCVHWM, 0)
        self._output_socket.setsockopt(zmq.LINGER, 0)
        self._output_socket.bind(output_address)
        self._output_sync = zmq.Socket.shadow(self._output_socket.underlying)
        self._output: zmq.asyncio.Socket | None = None  # set by attach()
        self.encoder = msgspec.msgpack.Encoder()
        self.outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.info: dict[str, Any] = {}
        self.kv_cache_config: KVCacheConfig | None = None  # from the core's READY message
        self.dead_message: str | None = None
        self._shutting_down = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_callbacks: list[Callable[[], None]] = []
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}
        spawn = multiprocessing.get_context("spawn")
        # A daemonic process may not start children: a core with worker processes (mp executor) is not one, and
        # is stopped at exit by shutdown() (registered after multiprocessing's own exit hook, so it runs first).
        daemon = _world_size(config) == 1
        name = "pagemill-engine-core" if engine_index is None else f"pagemill-engine-core-{engine_index}"
        self.proc = spawn.Process(target=core_proc.run_engine_core, name=name,
                                  args=(config, input_address, output_address, cpus, engine_index), daemon=daemon)
        self.proc.start()
        if not daemon:
            atexit.register(self.shutdown)

    # ---- life cycle ----
    def wait_ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Block until the core reports READY; raises EngineStartupError if it fails to start."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self._output_sync.poll(200):
                frames = self._output_sync.recv_multipart()
                if frames[0] == core_proc.READY:
                    self.info = msgspec.msgpack.decode(frames[1])
                    self.kv_cache_config = KVCacheConfig(**self.info["kv_cache_config"])
                    threading.Thread(target=self._monitor, name="pagemill-core-monitor", daemon=True).start()
                    logger.info("Engine core process ready (pid %d, %d KV blocks of %d tokens).",
                                self.info["pid"], self.kv_cache_config.usable_blocks, self.kv_cache_config.block_size)
                    return self.info
                if frames[0] == core_proc.DEAD:
                    self.shutdown()
                    raise EngineStartupError(msgspec.msgpack.decode(frames[1]))
            elif not self.proc.is_alive():
                self.shutdown()
                raise EngineStartupError(
                    f"Engine core process exited with code {self.proc.exitcode} while starting.")
        self.shutdown()
        raise EngineStartupError(f"Engine core process not ready after {timeout_s:.0f} s.")

    def _monitor(self) -> None:
        multiprocessing.connection.wait([self.proc.sentinel])
        if not self._shutting_down:
            self._mark_dead(f"Engine core process died unexpectedly (exit code {self.proc.exitcode}).")

    def _mark_dead(self, message: str) -> None:
        """Record the death (any thread) and run the callbacks on the event loop."""
        if self.dead_message is not None:
            return
        self.dead_message = message
        logger.error(message)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._run_dead_callbacks)
            except RuntimeError:  # loop closed meanwhile
                pass

    def _run_dead_callbacks(self) -> None:
        err = EngineDeadError(self.dead_message or "Engine core is dead.")
        for fut in self._pending_calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending_calls.clear()
        for cb in self._dead_callbacks:
            cb()

    def attach(self, loop: asyncio.AbstractEventLoop, on_dead: Callable[[], None]) -> None:
        """Bind the async output socket to `loop`; `on_dead` runs on it if the core dies."""
        self._loop = loop
        self._dead_callbacks.append(on_dead)
        self._output = self._output_socket
        if self.dead_message is not None:
            loop.call_soon(self._run_dead_callbacks)

    @property
    def is_dead(self) -> bool:
        """True once the core process has died."""
        return self.dead_message is not None

    @property
    def pid(self) -> int | None:
        """The engine core process id."""
        return self.proc.pid

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the core to stop, then terminate it if needed; close the sockets."""
        if self._shutting_down:
            return
        self._shutting_down = True
        if self.proc.is_alive():
            try:
                self.input.send_multipart([core_proc.SHUTDOWN], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout_s)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(2.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(2.0)
        for sock in (self.input, self._output_socket):
            sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ---- requests ----
    def _check_alive(self) -> None:
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to the core (never blocks: the socket queue is unbounded)."""
        self._check_alive()
        self.input.send_multipart([core_proc.ADD, self.encoder.encode(request)], copy=False)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Send several requests (a request's sequences): all are encoded before any is sent, so a request that
        cannot be encoded reaches the core with none of its parts."""
        self._check_alive()
        frames = [self.encoder.encode(r) for r in requests]
        for frame in frames:
            self.input.send_multipart([core_proc.ADD, frame], copy=False)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Ask the core to abort requests and free their blocks."""
        if request_ids and self.dead_message is None and not self._shutting_down:
            self.input.send_multipart([core_proc.ABORT, self.encoder.encode(request_ids)])

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call one of core_proc.UTILITY_METHODS in the core and return its result."""
        self._check_alive()
        if method not in core_proc.UTILITY_METHODS:
            raise ValueError(f"unknown engine utility method {method!r}.")
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = fut
        self.input.send_multipart([core_proc.UTILITY, self.encoder.encode((call_id, method, list(args)))])
        return await fut

    async def get_output(self) -> CoreOutputBatch:
        """The next batch of outputs from the core; raises EngineDeadError if it reported its death."""
        assert self._output is not None, "attach() the client to an event loop first"
        while True:
            frames = await self._output.recv_multipart(copy=False)
            kind = frames[0].bytes
            if kind == core_proc.OUTPUTS:
                return CoreOutputBatch(self.outputs_decoder.decode(frames[1].buffer))
            if kind == core_proc.UTILITY:
                call_id, ok, result = msgspec.msgpack.decode(frames[1].buffer)
                fut = self._pending_calls.pop(call_id, None)
                if fut is not None and not fut.done():
                    if ok:
                        fut.set_result(result)
                    else:
                        fut.set_exception(RuntimeError(result))
            elif kind == core_proc.REQUEST_ERROR:
                rid, message = msgspec.msgpack.decode(frames[1].buffer)
                return CoreOutputBatch(EngineCoreOutputs(), errors=[(rid, message)])
            elif kind == core_proc.DEAD:
                self._mark_dead(msgspec.msgpack.decode(frames[1].buffer))
                raise EngineDeadError(self.dead_message)
            else:
                logger.error("Unknown frame type %r from the engine core.", kind)


def _world_size(config: Any) -> int:
    """Worker ranks of an EngineConfig or of the EngineArgs it will be resolved from."""
    parallel = getattr(config, "parallel_config", None)
    if parallel is not None:
        return parallel.world_size
    return getattr(config, "tensor_parallel_size", 1) * getattr(config, "pipeline_parallel_size", 1)
