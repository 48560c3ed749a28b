"""AsyncLLM: the asyncio engine front end (tokenize, detokenize, stream) over the engine core process."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from pagemill.config import EngineConfig

from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.core_client import CoreOutputBatch, EngineCoreClient, EngineDeadError
from pagemill.engine.dp_core_client import DPEngineCoreClient, make_engine_core_client
from pagemill.engine.output_processor import OutputProcessor, first_scheduled_time
from pagemill.engine.processor import Processor, PromptType
from pagemill.loader.tokenizer import load_engine_tokenizer
from pagemill.lora.request import LoRARequest
from pagemill.metrics.logger import LoggingStatLogger
from pagemill.metrics.per_engine import PerEngineStatLogger
from pagemill.metrics.stats import FinishedRequestStats, IterationStats, StatLogger
from pagemill.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from pagemill.pooling_params import PoolingParams
from pagemill.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagemill.beam_search import BeamSearchParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "RequestOutputCollector"]


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Fold a newer DELTA output into one the consumer has not read yet."""
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if old.logprobs is None:
                old.logprobs = list(c.logprobs)
            else:
                old.logprobs.extend(c.logprobs)  # DELTA lists are fresh slices: ours to extend
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    into.finished = new.finished
    into.prompt_logprobs = new.prompt_logprobs
    into.num_cached_tokens = new.num_cached_tokens


class RequestOutputCollector:
    """One request's mailbox: holds at most one output; DELTA outputs that pile up are merged."""

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.kind = output_kind
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        """Deliver an output (merging with an unread one) or an error (which wins)."""
        if self.output is None or isinstance(item, BaseException):
            self.output = item
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            if self.kind == RequestOutputKind.DELTA:
                _merge_delta(self.output, item)
            else:
                self.output = item

    def get_nowait(self) -> RequestOutput | None:
        """The pending output, if any (raises the pending error)."""
        out, self.output = self.output, None
        self.ready.clear()
        if isinstance(out, BaseException):
            self.output = out  # every later read fails the same way
            raise out
        return out

    async def get(self) -> RequestOutput:
        """Wait for the next output."""
        while self.output is None:
            await self.ready.wait()
        return self.get_nowait()  # type: ignore[return-value]


class AsyncLLM:
    """Serve requests from asyncio: `async for out in llm.generate(prompt, params, request_id): ...`."""

    def __init__(self, config: EngineConfig, log_stats: bool = True,
                 stat_loggers: list[StatLogger] | None = None,
                 client: EngineCoreClient | DPEngineCoreClient | None = None) -> None:
        self.config = config
        self.model_config = config.model_config
        # Spawn the core first so that its model loading overlaps the tokenizer loading here (`client`: a core
        # already started from the same arguments, see from_engine_args).
        self.client = client or make_engine_core_client(config)
        try:
            mc = config.model_config
            self.tokenizer = load_engine_tokenizer(mc)
            self.processor = Processor(mc, self.tokenizer, config.structured_outputs_config)
            self.output_processor = OutputProcessor(self.tokenizer)
            self.client.wait_ready()
        except BaseException:
            self.client.shutdown()
            raise
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        if log_stats:
            now = time.monotonic()
            self.stat_loggers.append(
                LoggingStatLogger(now=now) if self.num_engines == 1 else
                PerEngineStatLogger([LoggingStatLogger(now=now, engine_index=i) for i in range(self.num_engines)]))
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._handler: asyncio.Task | None = None
        self._shut_down = False
        self._dead_callbacks: list[Callable[[], None]] = []

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None) -> "AsyncLLM":
        """Build from user-facing arguments (log_stats follows `disable_log_stats`).

        The engine core process starts first, from the arguments: it resolves the same configuration itself, so
        its ~2.5 s of imports (torch, transformers) overlap the front end's own configuration (~2 s of
        transformers imports) instead of following it.
        """
        client = make_engine_core_client(args)
        try:
            config = args.create_engine_config()
        except BaseException:
            client.shutdown(timeout_s=0.0)
            raise
        return cls(config, log_stats=not args.disable_log_stats, stat_loggers=stat_loggers, client=client)

    # ---- state ----
    @property
    def num_engines(self) -> int:
        """Engine core processes behind this front end (data_parallel_size)."""
        return self.config.data_parallel_config.data_parallel_size

    @property
    def errored(self) -> bool:
        """True once the engine core is dead."""
        return self.client.is_dead

    @property
    def is_running(self) -> bool:
        """True while requests can be served."""
        return not self.errored and not self._shut_down

    @property
    def dead_error(self) -> EngineDeadError:
        """The error pending requests get when the core is dead."""
        return EngineDeadError(self.client.dead_message or "The engine was shut down.")

    def get_tokenizer(self) -> Any:
        """The tokenizer the front end uses."""
        return self.tokenizer

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine cannot serve."""
        if not self.is_running:
            raise self.dead_error

    # ---- requests ----
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> RequestOutputCollector:
        """Validate and send a request to the core; raises ValueError (naming the field) or EngineDeadError."""
        if not self.is_running:
            raise self.dead_error
        self._ensure_output_handler()
        if request_id in self._collectors:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        text, req = self.processor.process(request_id, prompt, params, arrival_time, priority, cache_salt,
                                           lora_request)
        collector = RequestOutputCollector(params.output_kind)
        children = self.output_processor.add_request(text, req, collector)
        self._collectors[request_id] = collector
        try:
            self.client.add_requests(children)  # all of a request's sequences or none of them
        except BaseException:
            self._forget(request_id)
            raise
        return collector

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0, cache_salt: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the loop early (or being cancelled) aborts the request."""
        collector = self.add_request(request_id, prompt, sampling_params, None, priority, cache_salt, lora_request)
        async for out in self.iterate(request_id, collector):
            yield out

    async def beam_search(self, prompt_token_ids: list[int], request_id: str, params: "BeamSearchParams",
                          lora_request: LoRARequest | None = None) -> RequestOutput:
        """Beam search over one prompt (vLLM's EngineClient.beam_search): each step runs one one-token request per
        live beam, concurrently. Returns the `beam_width` best sequences, best first, as one finished RequestOutput
        (texts and token ids of the generated part only)."""
        from pagemill.beam_search import BeamSearcher

        tok = self.get_tokenizer()
        search = BeamSearcher([prompt_token_ids], params, tok.eos_token_id)

        async def one_step(rid: str, tokens: list[int]) -> RequestOutput:
            final = None
            async for out in self.generate({"prompt_token_ids": tokens}, search.step_params.clone(), rid,
                                           lora_request=lora_request):
                final = out
            assert final is not None
            return final

        while live := search.live():
            outs = await asyncio.gather(*(one_step(f"{request_id}-beam{search.steps}-{k}", beam.tokens)
                                          for k, (_, beam) in enumerate(live)))
            search.advance(live, [out.outputs[0].logprobs[0] for out in outs])
        n = len(prompt_token_ids)
        best = search.results(lambda tokens: tok.decode(tokens[n:], skip_special_tokens=True))[0].sequences
        outputs = [CompletionOutput(i, b.text or "", b.tokens[n:], b.cum_logprob, None, b.finish_reason, b.stop_reason)
                   for i, b in enumerate(best)]
        return RequestOutput(request_id, None, list(prompt_token_ids), None, outputs, True)

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams, request_id: str,
                     priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request's one output (its vector), as an iterator like `generate`; leaving early or being
        cancelled aborts it."""
        collector = self.add_request(request_id, prompt, pooling_params, None, priority)
        async for out in self.iterate(request_id, collector):
            yield out

    async def iterate(self, request_id: str, collector: RequestOutputCollector) -> AsyncIterator[RequestOutput]:
        """Yield the outputs of a request added with add_request; aborts it if the consumer stops early."""
        finished = False
        try:
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._abort([request_id])
            self._collectors.pop(request_id, None)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (and all their sequences); their blocks return to the pool.

        A consumer still iterating gets a last output with finish_reason "abort" and finished=True.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            collector = self._collectors.get(rid)
            seqs = [self.output_processor.states[sid] for sid in self.output_processor.sequence_ids([rid])]
            if collector is not None and seqs:
                outs = [CompletionOutput(s.index, "", [], finish_reason="abort") for s in seqs]
                collector.put_nowait(RequestOutput(rid, seqs[0].prompt, seqs[0].prompt_token_ids, None, outs, True))
        self._abort(ids)

    def abort_all(self, error: BaseException) -> int:
        """End every request in flight with `error` (their consumers raise it) and abort them in the core; returns
        how many there were."""
        request_ids = list(self._collectors)
        for rid in request_ids:
            self._collectors[rid].put_nowait(error)
        self._abort(request_ids)
        return len(request_ids)

    @property
    def num_requests_in_flight(self) -> int:
        """Requests added and not yet finished, aborted or consumed to the end."""
        return len(self._collectors)

    def add_dead_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback()` on the event loop once the engine core died (after its requests were failed)."""
        self._dead_callbacks.append(callback)

    def release(self, request_id: str) -> None:
        """Abort a request if it is still in flight (no-op once it finished or was aborted)."""
        if request_id in self._collectors:
            self._abort([request_id])

    def _abort(self, request_ids: list[str]) -> None:
        seq_ids = []
        for rid in request_ids:
            seq_ids.extend(self._forget(rid))
        self.output_processor.abort_requests(seq_ids)
        self.client.abort_requests(seq_ids)

    def _forget(self, request_id: str) -> list[str]:
        """Drop a request's bookkeeping; returns its sequence ids."""
        self._collectors.pop(request_id, None)
        return [s.request_id for s in self.output_processor.abort_requests([request_id])]

    # ---- utility calls ----
    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop the core's cached prefixes (only possible while idle, unless `reset_running_requests` preempts
        the running requests first)."""
        self._ensure_output_handler()
        return await self.client.call_utility("reset_prefix_cache", bool(reset_running_requests))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load (and check) an adapter in the core; True if it was not loaded yet; ValueError for a bad one."""
        self._ensure_output_handler()
        try:
            return await self.client.call_utility("add_lora", lora_request)
        except RuntimeError as e:
            raise ValueError(str(e).partition(": ")[2] or str(e)) from None

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter in the core; True if it was loaded."""
        self._ensure_output_handler()
        return await self.client.call_utility("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        """Ids of the adapters the core has loaded."""
        self._ensure_output_handler()
        return set(await self.client.call_utility("list_loras"))

    async def get_scheduler_stats(self) -> dict[str, Any]:
        """The core's current SchedulerStats as a dict (with data parallelism: the engines' sum)."""
        self._ensure_output_handler()
        return await self.client.call_utility("get_stats")

    async def get_engine_stats(self) -> list[dict[str, Any]]:
        """Each engine core's current SchedulerStats as a dict, by engine index (one entry without DP)."""
        self._ensure_output_handler()
        if isinstance(self.client, DPEngineCoreClient):
            return await self.client.call_utility_each("get_stats")
        return [await self.client.call_utility("get_stats")]

    # ---- output handling ----
    def start(self) -> None:
        """Start handling core outputs on the running event loop now (else the first request starts it), so that
        the engine core's death is noticed even while idle."""
        self._ensure_output_handler()

    def _ensure_output_handler(self) -> None:
        if self._handler is None:
            loop = asyncio.get_running_loop()
            self.client.attach(loop, self._on_engine_dead)
            self._handler = loop.create_task(self._output_handler(), name="pagemill-output-handler")

    async def _output_handler(self) -> None:
        try:
            while True:
                batch = await self.client.get_output()
                self._process_batch(batch)
        except EngineDeadError:
            self._on_engine_dead()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("Output handler failed; the engine is unusable.")
            self.client._mark_dead("The output handler failed.")
            self._on_engine_dead()

    def _process_batch(self, batch: CoreOutputBatch) -> None:
        """Deliver one batch of core outputs to the collectors, abort stop-string matches, record stats."""
        now = time.monotonic()
        op = self.output_processor
        for rid, message in batch.errors:
            self._fail_request(rid, ValueError(message))
        outputs = batch.outputs.outputs
        touched = [s for eco in outputs if (s := op.states.get(eco.request_id)) is not None]
        iteration = self._iteration_stats(batch, outputs, now) if self.stat_loggers else None
        _, to_abort = op.process_outputs(outputs)
        if to_abort:
            self.client.abort_requests(to_abort)
        if iteration is None:
            return
        iteration.finished.extend(
            FinishedRequestStats(s.finish_reason, now - s.metrics.arrival_time, len(s.prompt_token_ids),
                                 len(s.token_ids)) for s in touched if s.finish_reason not in (None, "abort"))
        for stat_logger in self.stat_loggers:
            stat_logger.record(batch.outputs.scheduler_stats, iteration, now, engine_idx=batch.engine_index)

    def _fail_request(self, seq_id: str, error: BaseException) -> None:
        """Abort the request a sequence belongs to and hand `error` to its consumer."""
        state = self.output_processor.states.get(seq_id)
        request_id = state.parent.request_id if state is not None and state.parent is not None else seq_id
        collector = self._collectors.get(request_id)
        self._abort([request_id])
        if collector is not None:
            collector.put_nowait(error)

    def _iteration_stats(self, batch: CoreOutputBatch, outputs: list, now: float) -> IterationStats:
        """Queue times, TTFT, inter-token latencies and token counts of a batch (before it is applied)."""
        states = self.output_processor.states
        iteration = IterationStats()
        for eco in outputs:
            state = states.get(eco.request_id)
            if state is None:
                continue
            if state.metrics.first_scheduled_time is None and eco.events:
                scheduled = first_scheduled_time(eco.events)
                if scheduled is not None:
                    iteration.queue_times.append(max(0.0, scheduled - state.metrics.arrival_time))
            if eco.pooling_output is not None:  # a pooled prompt counts as prompt tokens
                iteration.num_prompt_tokens += len(state.prompt_token_ids)
            if not eco.new_token_ids:
                continue
            iteration.num_generation_tokens += len(eco.new_token_ids)
            m = state.metrics
            if m.first_token_time is None:
                iteration.num_prompt_tokens += len(state.prompt_token_ids)
                iteration.time_to_first_tokens.append(now - m.arrival_time)
            else:
                iteration.inter_token_latencies.append(now - (m.last_token_time or m.first_token_time))
        return iteration

    def _on_engine_dead(self) -> None:
        """Fail every pending request (runs on the event loop)."""
        err = self.dead_error
        for collector in self._collectors.values():
            collector.put_nowait(err)
        self.output_processor.clear()
        if self._handler is not None and self._handler is not asyncio.current_task():
            self._handler.cancel()
        callbacks, self._dead_callbacks = self._dead_callbacks, []
        for callback in callbacks:
            callback()

    # ---- shutdown ----
    def shutdown(self) -> None:
        """Stop the engine core process and fail whatever is still pending."""
        if self._shut_down:
            return
        self._shut_down = True
        if self._handler is not None:
            self._handler.cancel()
        self.client.shutdown()
        err = EngineDeadError("The engine was shut down.")
        for collector in self._collectors.values():
            collector.put_nowait(err)
        self._collectors.clear()
        self.output_processor.clear()
