"""Prompt preparation off the event loop: tokenization and chat-template rendering run in worker threads, so that
no single request (a 10 MB prompt, a template that loops forever) stops the server from answering /health.

Tokenizers release the GIL while they encode. A template renders in Python (holding the GIL, but the interpreter
switches threads every few milliseconds); one that runs past its time limit is stopped by raising an exception in
its thread, at the next bytecode it executes.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class RenderTimeout(BaseException):
    """Raised inside a worker thread whose call ran past its time limit (a BaseException, so that the code it
    interrupts cannot mistake it for an error of its own)."""


class TimeLimitExceeded(Exception):
    """A call run with a time limit did not finish in time (it was stopped)."""


def _raise_in_thread(thread_id: int, exc_type: type[BaseException]) -> bool:
    """Ask the interpreter to raise `exc_type` in another thread at its next bytecode; True if the thread exists."""
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc_type)) == 1


class _TimedCall:
    """One call in its own thread that the caller may stop once: stopping is only possible while the call runs."""

    def __init__(self, func: Callable[..., T], args: tuple[Any, ...], loop: asyncio.AbstractEventLoop) -> None:
        self.func, self.args, self.loop = func, args, loop
        self.future: asyncio.Future = loop.create_future()
        self.lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self._run, name="pagemill-render", daemon=True)

    def _run(self) -> None:
        try:
            try:
                result: Any = self.func(*self.args)
                error: BaseException | None = None
            except BaseException as e:  # noqa: BLE001 - every outcome goes back to the caller
                result, error = None, e
            finally:
                with self.lock:
                    self.running = False
        except RenderTimeout:  # raised while leaving: the call had finished, the caller has given up on it
            return
        self.loop.call_soon_threadsafe(self._settle, result, error)

    def _settle(self, result: Any, error: BaseException | None) -> None:
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(TimeLimitExceeded() if isinstance(error, RenderTimeout) else error)
        else:
            self.future.set_result(result)

    def stop(self) -> None:
        """Raise RenderTimeout in the thread if the call is still running."""
        with self.lock:
            if self.running and self.thread.ident is not None:
                _raise_in_thread(self.thread.ident, RenderTimeout)


class PromptWorker:
    """Runs prompt preparation in threads: `await worker.run(f, *args)`, or with a time limit
    `await worker.run_limited(timeout_s, f, *args)` (raises TimeLimitExceeded)."""

    def __init__(self, max_workers: int = 4) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pagemill-prompt")

    async def run(self, func: Callable[..., T], *args: Any) -> T:
        """func(*args) in a pool thread."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, func, *args)

    async def run_limited(self, timeout_s: float, func: Callable[..., T], *args: Any) -> T:
        """func(*args) in a thread of its own, stopped after timeout_s seconds (pure-Python work only: a call that
        sits in C code stops when it returns to Python)."""
        call = _TimedCall(func, args, asyncio.get_running_loop())
        call.thread.start()
        try:
            return await asyncio.wait_for(asyncio.shield(call.future), timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            call.stop()
            call.future.cancel()  # nobody reads its outcome now
            if isinstance(e, asyncio.CancelledError):
                raise
            raise TimeLimitExceeded() from None

    def shutdown(self) -> None:
        """Stop taking work (threads finish what they run)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
