"""EngineCore: the busy loop's body: schedule -> execute -> update, on token ids only."""

from __future__ import annotations

import gc
import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pagemill.config import EngineConfig
from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagemill.core.scheduler import Scheduler
from pagemill.distributed.kv_transfer.base import KVConnectorRole
from pagemill.distributed.kv_transfer.factory import KVConnectorFactory
from pagemill.engine.step_profiler import StepProfiler
from pagemill.lora.request import LoRARequest
from pagemill.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagemill.metrics.kv_cache import KV_STATS_INTERVAL_S, hit_rate, kv_log_line
from pagemill.metrics.stats import SchedulerStats
from pagemill.request import Request, RequestStatus
from pagemill.spec_decode.backoff import SpeculativeBackoff
from pagemill.structured_output.manager import StructuredOutputManager
from pagemill.worker.executor_factory import executor_class
from pagemill.worker.launched_step import LaunchedStep
from pagemill.worker.step_queue import StepFuture

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_STEPS_IN_FLIGHT = 2  # async scheduling: the step running plus the one scheduled behind it (vLLM's batch queue)
ASYNC_SWITCH_INTERVAL_S = 5e-4  # the GIL hand-over interval with async scheduling (sys.setswitchinterval)


class EngineCore:
    """Owns the scheduler and the executor; knows nothing of text."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        # What is alive before loading (imported modules: ~1M objects with torch and transformers) is permanent:
        # the full collections that loading triggers, and the one below, then traverse only what loading made
        # (a SmolLM2 start: 0.18 -> 0.08 s of weight loading).
        gc.freeze()
        self.config = config
        self.executor = executor_class(config)(config)
        self.kv_cache_config = self.executor.kv_cache_config
        sc = config.scheduler_config
        needed = self.kv_cache_config.max_blocks_per_request(sc.max_model_len, sc.max_num_batched_tokens)
        if needed > self.kv_cache_config.usable_blocks:
            raise ValueError(
                f"kv_cache_memory holds {self.kv_cache_config.usable_blocks} blocks, fewer than one sequence of "
                f"max_model_len ({sc.max_model_len}) needs ({needed}): raise kv_cache_memory or lower max_model_len.")
        lora = config.lora_config
        spec = config.speculative_config
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.kv_cache_config, spec,
                                   lora.max_loras if lora is not None else 0,
                                   KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER),
                                   draft_policy=SpeculativeBackoff(spec) if spec is not None else None)
        self._last_log = self._last_memory = time.monotonic()
        # vLLM's batch queue: the steps submitted and not yet applied, oldest first (None: synchronous steps).
        # Async scheduling keeps two steps in flight (the next one is planned on output placeholders); pipeline
        # micro-batches keep one per stage (a batch's requests wait until its output is back).
        self.async_scheduling = config.scheduler_config.async_scheduling
        micro_batches = config.parallel_config.pipeline_micro_batching
        self.batch_queue_size = (MAX_STEPS_IN_FLIGHT if self.async_scheduling
                                 else self.executor.max_concurrent_batches if micro_batches else 1)
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput] | StepFuture | LaunchedStep, SchedulerOutput]] | None
        self.batch_queue = None
        if self.batch_queue_size > 1:
            self.batch_queue = deque()
            if not self.async_scheduling:
                self.scheduler.max_concurrent_batches = self.batch_queue_size
        if (self.async_scheduling and config.device_config.device == "cuda" and not self.executor.launches_steps
                and sys.getswitchinterval() > ASYNC_SWITCH_INTERVAL_S):
            # On a GPU the step thread waits for the device, then needs the GIL for a moment to start the next
            # step; with Python's 5 ms default it can wait that long behind the engine thread's scheduling, the
            # device idle meanwhile (on an H200 async steps served 256 sequences slower than synchronous ones, before
            # this). Not on the CPU, where the forward itself runs in the step thread and a shorter interval only
            # adds hand-overs (measured: 38.7 -> 44.1 ms per step at 256 sequences of a tiny model).
            sys.setswitchinterval(ASYNC_SWITCH_INTERVAL_S)
        self.profiler = StepProfiler(config.profile, overlapped_runner=self.async_scheduling)
        # Grammars for structured output (tokenizer: the front end's when in-process, else loaded on first use).
        self.structured_output_manager = StructuredOutputManager(config, tokenizer)
        self._retiring_loras: set[int] = set()  # unloaded adapters that unfinished requests still use
        # As vLLM after start-up: the loaded engine's long-lived objects (model, tokenizer, grammars' tables) move to
        # the permanent generation, so the collections that per-step allocations trigger no longer traverse them
        # (1.7% of a 1B decode step was gc_collect_main).
        gc.collect()
        gc.freeze()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request for scheduling; a bad structured-output constraint raises ValueError before queuing."""
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        req = Request.from_engine_core_request(request)
        req.pooling_params, req.token_type_ids = request.pooling_params, request.token_type_ids
        req.mm_features = request.mm_features
        self.structured_output_manager.add_request(req)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort requests and free their blocks; returns their final outputs."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if self._retiring_loras:
            self._retire_loras()
        return [EngineCoreOutput(r.request_id, [], finish_reason="abort") for r in done]

    def has_unfinished_requests(self) -> bool:
        """True while requests are running or waiting, or steps are in flight (batch queue)."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> EngineCoreOutputs:
        """One engine step (async scheduling: `step_async`; pipeline micro-batches: `step_with_batch_queue`)."""
        if self.async_scheduling:
            return self.step_async()
        if self.batch_queue is not None:
            return self.step_with_batch_queue()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs([], self.make_stats(), time.monotonic())
        so = self._schedule()
        return self._step_outputs(self._update(so, self.executor.execute_model(so)))

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """vLLM's step with a batch queue (pipeline micro-batches): while the queue has room, schedule a batch and
        submit it without waiting; only when no batch could be submitted, take the oldest batch's output (its
        requests can then be scheduled again)."""
        queue = self.batch_queue
        assert queue is not None
        scheduled, outputs = False, []
        if len(queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            so = self._schedule()
            scheduled = so.total_num_scheduled_tokens > 0
            if scheduled or _changes_workers(so):
                queue.append((self.executor.execute_model(so, non_block=True), so))
            elif not queue:  # nothing to run anywhere: report failed grammars, wait for compiles
                outputs = self._update(so, ModelRunnerOutput({}))
        if not scheduled and queue:
            future, so = queue.popleft()
            outputs = self._update(so, future.result())
        return self._step_outputs(outputs)

    def step_async(self) -> EngineCoreOutputs:
        """Async scheduling: submit steps until MAX_STEPS_IN_FLIGHT are in flight, then apply the oldest's output.

        Step N+1 is scheduled while the model runs step N: a request that samples in step N holds an output
        placeholder, and the runner feeds step N's token into step N+1 itself. While a structured-output request is
        live, the next step waits for the one in flight (its bitmask needs the real previous token): synchronous.
        """
        queue = self.batch_queue
        assert queue is not None
        while (len(queue) < MAX_STEPS_IN_FLIGHT and self.scheduler.has_unfinished_requests()
               and (not queue or not self.structured_output_manager.num_live)):
            so = self._schedule()
            queue.append((self.executor.execute_model_async(so), so))
        if not queue:
            return EngineCoreOutputs([], self.make_stats(), time.monotonic())
        future, so = queue.popleft()
        with self.profiler.section("wait"):  # the engine thread idle until the oldest step's output is there
            out = future.result()
        return self._step_outputs(self._update(so, out))

    def _drain(self) -> None:
        """Async scheduling: wait until no step is in flight (outputs, or a step's error, stay queued for step()),
        for calls that touch the workers' state. (Pipeline micro-batches: the executor orders such calls itself.)"""
        if self.async_scheduling and self.batch_queue:
            for future, _ in self.batch_queue:
                try:
                    future.result()  # (a launched step records its tokens; both keep an error for step())
                except Exception:
                    pass

    def _schedule(self) -> SchedulerOutput:
        """Plan one step and start its structured-output bitmask."""
        prof = self.profiler
        prof.steps += 1
        with prof.section("schedule"):
            so = self.scheduler.schedule()
        with prof.section("grammar"):  # starts the bitmask fill; the runner joins it before sampling
            so.grammar = self.structured_output_manager.start_bitmask(so, self.scheduler.requests)
        return so

    def _update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply a step's output to the requests; their outputs."""
        prof = self.profiler
        prof.add(out.timings)
        with prof.section("update"):
            outputs = self.scheduler.update_from_output(so, out)
        if self._retiring_loras:
            self._retire_loras()
        if so.total_num_scheduled_tokens == 0 and self.structured_output_manager.num_live:
            self.structured_output_manager.wait_for_compiles(0.01)  # only grammar-waiting requests: do not spin
        return outputs

    def _step_outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """The step's outputs with the scheduler's stats (and the periodic log lines)."""
        now = time.monotonic()
        log_now = self.config.log_stats and now - self._last_log > 5.0
        # The KV accounting (O(requests)) for /metrics and the logs: every KV_STATS_INTERVAL_S, and once drained.
        with_memory = (log_now or now - self._last_memory >= KV_STATS_INTERVAL_S
                       or not self.scheduler.has_unfinished_requests())
        stats = self.scheduler.make_stats(include_memory=with_memory)
        if with_memory:
            self._last_memory = now
        if log_now:
            self._last_log = now
            logger.info("Running: %d reqs, Waiting: %d reqs, Swapped: %d reqs, KV cache usage: %.1f%%, "
                        "Prefix cache hit rate: %.1f%%", stats.num_running_reqs, stats.num_waiting_reqs,
                        stats.num_swapped_reqs, 100 * stats.kv_cache_usage,
                        100 * hit_rate(stats.prefix_cache_hits, stats.prefix_cache_queries))
            logger.info(kv_log_line(stats.memory))
        return EngineCoreOutputs(outputs, stats, time.monotonic())

    def make_stats(self) -> SchedulerStats:
        """Scheduler and KV cache counters now (cheap: the memory accounting only when nothing is left to run)."""
        return self.scheduler.make_stats(include_memory=not self.scheduler.has_unfinished_requests())

    def get_stats(self) -> SchedulerStats:
        """Scheduler and KV memory statistics now, including the memory accounting."""
        return self.scheduler.make_stats(include_memory=True)

    def apply_model(self, func: Callable[[Any], T]) -> list[T]:
        """func(model) on every worker's model, as vLLM's `LLM.apply_model` (with worker processes: a picklable
        module-level function)."""
        self._drain()
        return self.executor.apply_model(func)

    def shutdown(self) -> None:
        """Stop the executor's workers (after the async steps in flight; pipeline batches in flight are dropped)
        and the scheduler's KV connector."""
        self._drain()
        self.executor.stop_step_thread()
        self.executor.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()

    def check_health(self) -> None:
        """Raise if a worker is dead (the core process checks while idle, so /health fails without traffic)."""
        self.executor.check_health()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop cached prefixes: when idle, or after preempting the running requests if `reset_running_requests`."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    # ---- LoRA adapters ----
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load (and check) an adapter on the worker; True if it was not loaded yet. ValueError for a bad one."""
        if self.config.lora_config is None:
            raise ValueError("lora_request: LoRA is not enabled (start the engine with enable_lora=True).")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
        self._retiring_loras.discard(lora_request.lora_int_id)
        self._drain()  # (the in-process worker's adapter slots are not swapped under a running forward)
        return self.executor.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; True if it was loaded. Unfinished requests using it finish with it: it stays loaded
        (pinned, so they need not reload it from a path that may be gone by then) until the last of them ends."""
        if self.config.lora_config is None:
            return False
        if any(r.lora_int_id == lora_id for r in self.scheduler.requests.values()):
            self._retiring_loras.add(lora_id)
            self._drain()
            if lora_id in self.executor.list_loras():
                self.executor.pin_lora(lora_id)
            return True
        self._drain()
        return self.executor.remove_lora(lora_id)

    def _retire_loras(self) -> None:
        """Drop the unloaded adapters no unfinished request uses any more."""
        in_use = {r.lora_int_id for r in self.scheduler.requests.values()}
        if self._retiring_loras - in_use:
            self._drain()
        for lora_id in self._retiring_loras - in_use:
            self.executor.remove_lora(lora_id)
        self._retiring_loras &= in_use

    def list_loras(self) -> list[int]:
        """Ids of the adapters loaded on the worker."""
        if self.config.lora_config is None:
            return []
        self._drain()
        return self.executor.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        """Keep an adapter loaded whatever the LRU says."""
        if self.config.lora_config is None:
            raise ValueError("LoRA is not enabled.")
        self._drain()
        return self.executor.pin_lora(lora_id)


def _changes_workers(so: SchedulerOutput) -> bool:
    """Whether a step with no tokens to compute still carries what the workers must apply (in order)."""
    return bool(so.finished_req_ids or so.preempted_req_ids or so.blocks_to_copy or so.blocks_to_swap_out
                or so.blocks_to_swap_in)
