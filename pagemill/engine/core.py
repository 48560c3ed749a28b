"""EngineCore: the busy loop's body: schedule -> execute -> update, on token ids only."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pagemill.config import EngineConfig
from pagemill.core.scheduler import Scheduler
from pagemill.engine.step_profiler import StepProfiler
from pagemill.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagemill.metrics.stats import SchedulerStats
from pagemill.request import Request, RequestStatus
from pagemill.structured_output.manager import StructuredOutputManager
from pagemill.worker.executor import UniProcExecutor

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineCore:
    """Owns the scheduler and the executor; knows nothing of text."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        self.config = config
        self.executor = UniProcExecutor(config)
        self.kv_cache_config = self.executor.kv_cache_config
        sc = config.scheduler_config
        needed = self.kv_cache_config.max_blocks_per_request(sc.max_model_len, sc.max_num_batched_tokens)
        if needed > self.kv_cache_config.usable_blocks:
            raise ValueError(
                f"kv_cache_memory holds {self.kv_cache_config.usable_blocks} blocks, fewer than one sequence of "
                f"max_model_len ({sc.max_model_len}) needs ({needed}): raise kv_cache_memory or lower max_model_len.")
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.kv_cache_config,
                                   config.speculative_config)
        self._last_log = time.monotonic()
        self.profiler = StepProfiler(config.profile)
        # Grammars for structured output (tokenizer: the front end's when in-process, else loaded on first use).
        self.structured_output_manager = StructuredOutputManager(config, tokenizer)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request for scheduling; a bad structured-output constraint raises ValueError before queuing."""
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        req = Request.from_engine_core_request(request)
        req.pooling_params, req.token_type_ids = request.pooling_params, request.token_type_ids
        self.structured_output_manager.add_request(req)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort requests and free their blocks; returns their final outputs."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [EngineCoreOutput(r.request_id, [], finish_reason="abort") for r in done]

    def has_unfinished_requests(self) -> bool:
        """True while requests are running or waiting."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """One engine step."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs([], self.make_stats(), time.monotonic())
        prof = self.profiler
        prof.steps += 1
        with prof.section("schedule"):
            so = self.scheduler.schedule()
        with prof.section("grammar"):  # starts the bitmask fill; the runner joins it before sampling
            so.grammar = self.structured_output_manager.start_bitmask(so, self.scheduler.requests)
        out = self.executor.execute_model(so)
        prof.add(out.timings)
        with prof.section("update"):
            outputs = self.scheduler.update_from_output(so, out)
        if so.total_num_scheduled_tokens == 0 and self.structured_output_manager.num_live:
            self.structured_output_manager.wait_for_compiles(0.01)  # only grammar-waiting requests: do not spin
        log_now = self.config.log_stats and time.monotonic() - self._last_log > 5.0
        stats = self.scheduler.make_stats(include_memory=log_now)
        if log_now:
            self._last_log = time.monotonic()
            mem = stats.memory
            logger.info("Running: %d reqs, Waiting: %d reqs, Swapped: %d reqs, KV cache usage: %.1f%%, "
                        "Prefix cache hit rate: %.1f%%, KV blocks shared: %d, saved by sharing: %.1f%%, "
                        "reserved but unused slots: %d", stats.num_running_reqs, stats.num_waiting_reqs,
                        stats.num_swapped_reqs, 100 * stats.kv_cache_usage,
                        100 * stats.prefix_cache_hits / max(1, stats.prefix_cache_queries), mem["blocks_shared"],
                        100 * mem["sharing_saving"], mem["slots_reserved_unused"])
        return EngineCoreOutputs(outputs, stats, time.monotonic())

    def make_stats(self) -> SchedulerStats:
        """Scheduler and KV cache counters now (cheap: no memory accounting)."""
        return self.scheduler.make_stats()

    def get_stats(self) -> SchedulerStats:
        """Scheduler and KV memory statistics now, including the memory accounting."""
        return self.scheduler.make_stats(include_memory=True)

    def apply_model(self, func: Callable[[Any], T]) -> list[T]:
        """func(model) on every worker's model (one here), as vLLM's `LLM.apply_model`."""
        return self.executor.apply_model(func)

    def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes (only when idle)."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()
