"""LLMEngine: the synchronous, in-process engine (processor -> engine core -> output processor)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from pagemill.config import EngineConfig

from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.core import EngineCore
from pagemill.engine.dp_sync_core import DPSyncEngineCore
from pagemill.engine.output_processor import OutputProcessor
from pagemill.engine.processor import Processor, PromptType
from pagemill.loader.tokenizer import load_engine_tokenizer
from pagemill.lora.request import LoRARequest
from pagemill.messages import EngineCoreRequest
from pagemill.metrics.stats import SchedulerStats
from pagemill.outputs import RequestOutput
from pagemill.sampling_params import SamplingParams


class LLMEngine:
    """Adds requests and steps the engine; each step returns the outputs it completed."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        self.tokenizer = load_engine_tokenizer(mc)
        self.processor = Processor(mc, self.tokenizer, config.structured_outputs_config)
        # data_parallel_size > 1: engine core processes behind the same methods (engine/dp_sync_core.py)
        self.engine_core: EngineCore | DPSyncEngineCore = (
            EngineCore(config, self.tokenizer) if config.data_parallel_config.data_parallel_size == 1
            else DPSyncEngineCore(config))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.last_stats = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Build from user-facing arguments."""
        return cls(args.create_engine_config())

    def get_tokenizer(self) -> Any:
        """The tokenizer in use."""
        return self.tokenizer

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    queue: Any = None, lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request; n > 1 fans out into child sequences sharing the prompt."""
        text, req = self.processor.process(request_id, prompt, params, arrival_time, priority, cache_salt,
                                           lora_request)
        self.add_processed_request(text, req, queue)

    def add_processed_request(self, text: str | None, req: EngineCoreRequest, queue: Any = None) -> None:
        """Queue a request the processor already validated (see `Processor.process`)."""
        for child in self.output_processor.add_request(text, req, queue):
            self.engine_core.add_request(child)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests (and all their child sequences)."""
        dropped = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests([s.request_id for s in dropped])

    def has_unfinished_requests(self) -> bool:
        """True while anything is in flight."""
        return self.engine_core.has_unfinished_requests() or self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the request outputs it produced."""
        core_out = self.engine_core.step()
        self.last_stats = core_out.scheduler_stats
        with self.engine_core.profiler.section("output"):
            outputs, to_abort = self.output_processor.process_outputs(core_out.outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        return outputs

    def get_stats(self) -> SchedulerStats:
        """The engine core's scheduler and KV cache statistics now (with the memory accounting)."""
        return self.engine_core.get_stats()

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """func(model) on every worker's model (in-process engine core)."""
        return self.engine_core.apply_model(func)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop cached prefixes; only possible while idle, unless `reset_running_requests` preempts the running
        requests first (they recompute their KV)."""
        return self.engine_core.reset_prefix_cache(reset_running_requests)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of its requests; True if it was not loaded yet (ValueError for a bad one)."""
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; True if it was loaded."""
        return self.engine_core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """Ids of the loaded adapters."""
        return set(self.engine_core.list_loras())

    def pin_lora(self, lora_id: int) -> bool:
        """Keep an adapter loaded whatever the LRU says."""
        return self.engine_core.pin_lora(lora_id)

    def shutdown(self) -> None:
        """Stop the engine core processes of data parallelism (nothing to do for the in-process core)."""
        if isinstance(self.engine_core, DPSyncEngineCore):
            self.engine_core.shutdown()

    def next_request_id(self) -> str:
        """A fresh request id."""
        return str(next(self._ids))
