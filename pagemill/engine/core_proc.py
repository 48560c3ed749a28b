"""The engine core in its own process: a busy loop between two ZMQ sockets (msgpack on the wire).

Frames front end -> core: [ADD, EngineCoreRequest] | [ABORT, list[str]] | [UTILITY, (call_id, method, args)]
| [SHUTDOWN].  Core -> front end: [READY, {pid, kv_cache_config}] | [OUTPUTS, EngineCoreOutputs]
| [UTILITY, (call_id, ok, result)] | [REQUEST_ERROR, (request_id, message)] | [DEAD, message].
Scheduling and preemption times travel as events on the outputs (EngineCoreOutput.events).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import msgspec
import zmq

from pagemill.config import EngineConfig

from pagemill.engine.arg_utils import EngineArgs
from pagemill.lora.request import LoRARequest
from pagemill.messages import EngineCoreOutputs, EngineCoreRequest
from pagemill.utils.memory import release_free_memory

logger = logging.getLogger(__name__)

# Frame types (first frame of every multipart message).
ADD, ABORT, UTILITY, SHUTDOWN = b"A", b"X", b"U", b"S"
READY, OUTPUTS, REQUEST_ERROR, DEAD = b"R", b"O", b"E", b"D"

# Methods the front end may call with a UTILITY frame.
UTILITY_METHODS = ("reset_prefix_cache", "get_stats", "ping", "add_lora", "remove_lora", "list_loras")

_IDLE_POLL_MS = 1000  # how often the core checks that its parent (the front end) is still alive
_EXIT_DEADLINE_S = 8.0  # stopping the workers (<= ~4 s) and flushing the outputs (linger 2 s) fit well inside


class EngineCoreProc:
    """Runs an EngineCore and moves its inputs and outputs over ZMQ."""

    def __init__(self, config: EngineConfig | EngineArgs, input_address: str, output_address: str) -> None:
        self.ctx = zmq.Context(1)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_address)
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.RCVHWM, 0)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.connect(input_address)
        self.encoder = msgspec.msgpack.Encoder()
        self.request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.parent_pid = os.getppid()
        self.running = True
        try:
            from pagemill.engine.core import EngineCore

            if isinstance(config, EngineArgs):  # started before the front end had resolved it (same result)
                config = config.create_engine_config()
            # The front end logs stats; the core must not log them a second time.
            self.core = EngineCore(dataclasses.replace(config, log_stats=False))
        except BaseException as e:
            self._send(DEAD, f"Engine core failed to start: {type(e).__name__}: {e}")
            self.close()
            raise
        self._send(READY, {"pid": os.getpid(), "kv_cache_config": dataclasses.asdict(self.core.kv_cache_config)})

    def _send(self, kind: bytes, *payloads: Any) -> None:
        self.output.send_multipart([kind, *(self.encoder.encode(p) for p in payloads)], copy=False)

    def run(self) -> None:
        """The busy loop: drain inputs, step while there is work, block on the input when idle."""
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        last_check = time.monotonic()
        worked_since_trim = False
        while self.running:
            if not self.core.has_unfinished_requests() and not poller.poll(_IDLE_POLL_MS):
                last_check = 0.0  # idle: check the parent now
                if worked_since_trim:  # idle for a whole poll after some work: give freed memory back
                    release_free_memory()
                    worked_since_trim = False
            if time.monotonic() - last_check >= _IDLE_POLL_MS / 1000:
                if os.getppid() != self.parent_pid:
                    logger.warning("Front end process is gone; engine core exits.")
                    return
                self.core.check_health()  # a dead worker ends the loop: the front end hears DEAD
                last_check = time.monotonic()
            self._drain_inputs()
            if self.running and self.core.has_unfinished_requests():
                self._step()
                worked_since_trim = True

    def _drain_inputs(self) -> None:
        while self.running:
            try:
                frames = self.input.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames[0].bytes, [f.buffer for f in frames[1:]])

    def _handle(self, kind: bytes, payloads: list[memoryview]) -> None:
        if kind == ADD:
            req = self.request_decoder.decode(payloads[0])
            try:
                self.core.add_request(req)
            except ValueError as e:
                self._send(REQUEST_ERROR, (req.request_id, str(e)))
        elif kind == ABORT:
            ids = msgspec.msgpack.decode(payloads[0], type=list[str])
            done = self.core.abort_requests(ids)
            self._send(OUTPUTS, EngineCoreOutputs(done, self.core.make_stats()))
        elif kind == UTILITY:
            call_id, method, args = msgspec.msgpack.decode(payloads[0])
            self._send(UTILITY, self._call_utility(call_id, method, args))
        elif kind == SHUTDOWN:
            self.running = False
        else:
            logger.error("Engine core got an unknown frame type %r.", kind)

    def _call_utility(self, call_id: int, method: str, args: list[Any]) -> tuple[int, bool, Any]:
        if method not in UTILITY_METHODS:
            return call_id, False, f"unknown utility method {method!r}"
        try:
            if method == "reset_prefix_cache":
                return call_id, True, self.core.reset_prefix_cache(*args[:1])
            if method == "get_stats":
                return call_id, True, msgspec.to_builtins(self.core.get_stats())
            if method == "add_lora":
                return call_id, True, self.core.add_lora(msgspec.convert(args[0], LoRARequest))
            if method == "remove_lora":
                return call_id, True, self.core.remove_lora(int(args[0]))
            if method == "list_loras":
                return call_id, True, self.core.list_loras()
            return call_id, True, "pong"
        except Exception as e:  # a failed utility call is the caller's problem, not the engine's
            return call_id, False, f"{type(e).__name__}: {e}"

    def _step(self) -> None:
        self._send(OUTPUTS, self.core.step())

    def close(self) -> None:
        """Stop the workers and close the sockets (pending outputs are flushed for up to the linger time)."""
        if hasattr(self, "core"):
            self.core.shutdown()
        self.input.close()
        self.output.close()
        self.ctx.term()


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def arm_exit_watchdog(seconds: float = _EXIT_DEADLINE_S) -> None:
    """End the process `seconds` from now, printing every thread's stack first, unless it has exited by then: a hang
    while winding down (a worker, a socket, a thread joined at interpreter exit) must not keep a dead core alive."""
    if sys.stderr is not None:  # faulthandler writes the stacks there
        faulthandler.dump_traceback_later(seconds, exit=True)


def run_engine_core(config: EngineConfig | EngineArgs, input_address: str, output_address: str,
                    cpus: list[int] | None = None, engine_index: int | None = None) -> None:
    """Process entry point (multiprocessing spawn target); `cpus`: the cores it is pinned to (data parallelism),
    set before torch starts its threads."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    name = "engine core" if engine_index is None else f"engine core {engine_index}"
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s [{name}] %(message)s")
    # SIGINT goes to the whole process group on Ctrl-C: the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        proc = EngineCoreProc(config, input_address, output_address)
    except ValueError:  # a configuration error: already reported to the front end, which prints it
        raise SystemExit(1) from None
    except SystemExit:
        return
    error: BaseException | None = None
    try:
        proc.run()
    except SystemExit:
        pass
    except BaseException as e:
        error = e
        logger.error("Engine core died:\n%s", traceback.format_exc())
    arm_exit_watchdog()  # from here the process only winds down
    try:
        if error is not None:
            proc._send(DEAD, f"Engine core died: {type(error).__name__}: {error}")
    except Exception:
        pass
    finally:
        proc.close()
    if error is not None:
        raise SystemExit(1)
