"""The synchronous face of the data-parallel client, for LLM / LLMEngine: the DP client runs on a private event loop
in a thread, and this object offers the in-process EngineCore's methods over it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from pagemill.config import EngineConfig
from pagemill.engine.dp_core_client import DPEngineCoreClient
from pagemill.engine.step_profiler import StepProfiler
from pagemill.lora.request import LoRARequest
from pagemill.messages import EngineCoreOutputs, EngineCoreRequest
from pagemill.metrics.stats import SchedulerStats


class DPSyncEngineCore:
    """EngineCore's interface (add_request, abort_requests, step, utility calls) over N engine core processes."""

    def __init__(self, config: EngineConfig) -> None:
        """Spawn the engines and wait until they are ready."""
        self.profiler = StepProfiler(False)
        self.client = DPEngineCoreClient(config, config.data_parallel_config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pagemill-dp-loop", daemon=True)
        try:
            self.client.wait_ready()
            self._thread.start()
            self._call(self.client.attach, self.loop, lambda: None)
        except BaseException:
            self.shutdown()
            raise

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the loop's thread (the client's sockets are used from that thread only)."""
        async def call() -> Any:
            return fn(*args)

        return self._run(call())

    def add_request(self, request: EngineCoreRequest) -> None:
        """Route a request to an engine."""
        self._call(self.client.add_request, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests on the engines that run them."""
        self._call(self.client.abort_requests, request_ids)

    def has_unfinished_requests(self) -> bool:
        """True while a request is in flight on any engine."""
        return bool(self.client.engine_of)

    def step(self) -> EngineCoreOutputs:
        """The next batch of outputs from any engine (blocks until one comes); a request the engine rejected
        raises its ValueError."""
        batch = self._run(self.client.get_output())
        if batch.errors:
            raise ValueError("; ".join(message for _, message in batch.errors))
        return batch.outputs

    def get_stats(self) -> SchedulerStats:
        """The engines' statistics, added up."""
        return msgspec.convert(self._run(self.client.call_utility("get_stats")), SchedulerStats)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every engine's cached prefixes."""
        return self._run(self.client.call_utility("reset_prefix_cache", bool(reset_running_requests)))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter in every engine (ValueError for a bad one)."""
        try:
            return self._run(self.client.call_utility("add_lora", lora_request))
        except RuntimeError as e:
            raise ValueError(str(e).partition(": ")[2] or str(e)) from None

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter from every engine."""
        return self._run(self.client.call_utility("remove_lora", lora_id))

    def list_loras(self) -> list[int]:
        """Ids of the adapters the engines have loaded."""
        return self._run(self.client.call_utility("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        """Not available across processes."""
        raise ValueError("pin_lora is not available with data_parallel_size > 1.")

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """Not available: the models live in other processes."""
        raise ValueError("apply_model needs the model in this process: not available with data_parallel_size > 1.")

    def shutdown(self) -> None:
        """Stop the engines and the loop."""
        self.client.shutdown()
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
