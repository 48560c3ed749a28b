"""Data parallelism: N engine core processes behind one front end (vLLM's DP load-balancing client).

Each engine has its own scheduler and KV cache and is pinned to its share of the cores. A request goes to one
engine (dp_router.DPRouter) and stays there: its aborts and its n > 1 siblings follow it. Utility calls fan out
to every engine. One engine dying makes the whole client dead: every in-flight request fails and /health fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec

from pagemill.config import DataParallelConfig, EngineConfig
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.core_client import CoreOutputBatch, EngineCoreClient, EngineDeadError
from pagemill.engine.dp_router import DPRouter
from pagemill.messages import EngineCoreRequest
from pagemill.metrics.stats import SchedulerStats

logger = logging.getLogger(__name__)


def dp_config_of(config: EngineConfig | EngineArgs) -> DataParallelConfig:
    """The data-parallel configuration of resolved or user-facing arguments."""
    if isinstance(config, EngineConfig):
        return config.data_parallel_config
    return config.create_data_parallel_config()


def make_engine_core_client(config: EngineConfig | EngineArgs) -> EngineCoreClient | DPEngineCoreClient:
    """One engine core process, or N of them behind a DP client when data_parallel_size > 1."""
    dp = dp_config_of(config)
    if dp.data_parallel_size == 1:
        return EngineCoreClient(config)
    return DPEngineCoreClient(config, dp)


def split_cpus(cpus: list[int], n: int) -> list[list[int]]:
    """n equal contiguous shares of the cores (engines share cores round-robin when there are fewer than n)."""
    if len(cpus) < n:
        return [[cpus[i % len(cpus)]] for i in range(n)]
    per = len(cpus) // n
    return [cpus[i * per:(i + 1) * per] for i in range(n)]


# How the results of a utility call on every engine combine into one.
_COMBINE: dict[str, Callable[[list[Any]], Any]] = {
    "reset_prefix_cache": all,
    "add_lora": any,
    "remove_lora": any,
    "list_loras": lambda results: sorted(set().union(*map(set, results))),
    "ping": lambda results: results[0],
}


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The engines' counters added up (the KV usage averaged: each engine has its own cache)."""
    total = SchedulerStats()
    for s in stats:
        for f in ("num_running_reqs", "num_waiting_reqs", "num_blocks_total", "num_blocks_free",
                  "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_swapped_reqs",
                  "num_swapped_out", "num_swap_blocks_total", "num_swap_blocks_free", "num_cow_copies",
                  "num_prompt_tokens", "num_generation_tokens"):
            setattr(total, f, getattr(total, f) + getattr(s, f))
    used = total.num_blocks_total - total.num_blocks_free
    total.kv_cache_usage = used / total.num_blocks_total if total.num_blocks_total else 0.0
    return total


class DPEngineCoreClient:
    """N EngineCoreClients behind the interface of one (AsyncLLM cannot tell the difference)."""

    def __init__(self, config: EngineConfig | EngineArgs, dp: DataParallelConfig) -> None:
        """Spawn the engines, each with cores / N threads pinned to its own cores."""
        n = dp.data_parallel_size
        self.dp = dp
        shares = split_cpus(sorted(os.sched_getaffinity(0)), n)
        self.cpus = shares
        self.engines: list[EngineCoreClient] = []
        self._pumps: list[asyncio.Task] = []
        self._shutting_down = False
        try:
            for i, cpus in enumerate(shares):
                # --num-threads is per engine; by default an engine uses exactly its share of the cores.
                engine_config = dataclasses.replace(config, num_threads=config.num_threads or len(cpus))
                self.engines.append(EngineCoreClient(engine_config, engine_index=i, cpus=cpus))
        except BaseException:
            self.shutdown()
            raise
        self.config = config
        self.router: DPRouter | None = None
        self.engine_of: dict[str, int] = {}  # in-flight request (sequence) id -> its engine
        self.last_stats: list[SchedulerStats | None] = [None] * n
        self._dead_message: str | None = None
        self._dead_callbacks: list[Callable[[], None]] = []
        self._queue: asyncio.Queue[CoreOutputBatch | BaseException] | None = None

    @property
    def num_engines(self) -> int:
        """data_parallel_size."""
        return len(self.engines)

    # ---- life cycle ----
    def wait_ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Block until every engine reports READY; raises EngineStartupError (naming the engine) otherwise."""
        try:
            for e in self.engines:
                e.wait_ready(timeout_s)
        except BaseException:
            self.shutdown()
            raise
        cache = self.engines[0].kv_cache_config
        assert cache is not None
        c = self.config
        algo, prefix_caching = (
            (c.cache_config.prefix_caching_hash_algo, c.cache_config.enable_prefix_caching)
            if isinstance(c, EngineConfig) else (c.prefix_caching_hash_algo, c.enable_prefix_caching))
        self.router = DPRouter(self.dp, cache.block_size, algo, prefix_caching,
                               [e.kv_cache_config.usable_blocks for e in self.engines])  # type: ignore[union-attr]
        logger.info("Data parallel: %d engine cores (pids %s) on cores %s, routing %s.", self.num_engines,
                    ", ".join(str(e.pid) for e in self.engines), self.cpus, self.dp.routing)
        return self.engines[0].info

    @property
    def info(self) -> dict[str, Any]:
        """The first engine's READY message."""
        return self.engines[0].info

    @property
    def kv_cache_config(self) -> KVCacheConfig | None:
        """One engine's KV cache (every engine has its own of the same size)."""
        return self.engines[0].kv_cache_config

    @property
    def pid(self) -> int | None:
        """The first engine core's process id."""
        return self.engines[0].pid

    @property
    def pids(self) -> list[int | None]:
        """Every engine core's process id, by engine index."""
        return [e.pid for e in self.engines]

    @property
    def dead_message(self) -> str | None:
        """Why the client is dead (the first engine that died, even before an event loop noticed), else None."""
        if self._dead_message is None:
            for i, e in enumerate(self.engines):
                if e.dead_message is not None:
                    return f"Data-parallel engine {i} is dead: {e.dead_message}"
        return self._dead_message

    @property
    def is_dead(self) -> bool:
        """True once any engine died."""
        return self.dead_message is not None

    def attach(self, loop: asyncio.AbstractEventLoop, on_dead: Callable[[], None]) -> None:
        """Bind every engine's output socket to `loop` and start reading them; `on_dead` runs if one dies."""
        self._dead_callbacks.append(on_dead)
        if self._queue is None:
            self._queue = asyncio.Queue()
            for i, e in enumerate(self.engines):
                e.attach(loop, lambda i=i: self._engine_died(i))
                self._pumps.append(loop.create_task(self._pump(i), name=f"pagemill-dp-output-{i}"))
        if self._dead_message is not None:
            loop.call_soon(self._run_dead_callbacks)

    async def _pump(self, i: int) -> None:
        """Move engine i's outputs into the shared queue, keeping the router's view of its load current."""
        engine = self.engines[i]
        assert self._queue is not None and self.router is not None
        try:
            while True:
                batch = await engine.get_output()
                batch.engine_index = i
                stats = batch.outputs.scheduler_stats
                if stats is not None:
                    self.last_stats[i] = stats
                    self.router.update_stats(i, stats)
                for eco in batch.outputs.outputs:
                    if eco.finish_reason is not None:
                        self.engine_of.pop(eco.request_id, None)
                for rid, _ in batch.errors:
                    self.engine_of.pop(rid, None)
                self._queue.put_nowait(batch)
        except EngineDeadError:
            self._engine_died(i)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("Reading data-parallel engine %d failed.", i)
            self._mark_dead(f"Reading data-parallel engine {i} failed: {type(e).__name__}: {e}")

    def _engine_died(self, i: int) -> None:
        message = self.engines[i].dead_message or "it died"
        self._mark_dead(f"Data-parallel engine {i} is dead: {message}")

    def _mark_dead(self, message: str) -> None:
        """Record the first death; the survivors drop their in-flight requests, and the front end fails them."""
        if self._dead_message is not None or self._shutting_down:
            return
        self._dead_message = message
        logger.error(message)
        by_engine: dict[int, list[str]] = {}
        for rid, i in self.engine_of.items():
            by_engine.setdefault(i, []).append(rid)
        self.engine_of.clear()
        for i, rids in by_engine.items():
            self.engines[i].abort_requests(rids)
        self._run_dead_callbacks()

    def _run_dead_callbacks(self) -> None:
        if self._queue is not None:
            self._queue.put_nowait(EngineDeadError(self.dead_message or "An engine is dead."))
        for cb in self._dead_callbacks:
            cb()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every engine core process."""
        if self._shutting_down:
            return
        self._shutting_down = True
        for task in self._pumps:
            task.cancel()
        for e in self.engines:
            e.shutdown(timeout_s)

    # ---- requests ----
    def _check_alive(self) -> None:
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to the engine the router picks (a sibling of an n > 1 request: to its parent's)."""
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Send a request's sequences to one engine (the router's pick for the first; a late sibling follows its
        parent), all encoded before any is sent."""
        self._check_alive()
        assert self.router is not None, "wait_ready() first"
        first = requests[0]
        sibling = self.engine_of.get(first.fork_of) if first.fork_of is not None else None
        if sibling is not None:
            i = sibling
            self.router.assign(i)
        else:
            i = self.router.route(first)
        for _ in requests[1:]:
            self.router.assign(i)
        self.engines[i].add_requests(requests)
        for request in requests:
            self.engine_of[request.request_id] = i

    def abort_requests(self, request_ids: list[str]) -> None:
        """Send each abort to the engine its request runs on."""
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self.engine_of.pop(rid, None)
            if i is not None:
                by_engine.setdefault(i, []).append(rid)
        for i, rids in by_engine.items():
            self.engines[i].abort_requests(rids)

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call a utility method on every engine and combine the results (get_stats: the sum)."""
        self._check_alive()
        results = await asyncio.gather(*(e.call_utility(method, *args) for e in self.engines))
        if method == "get_stats":
            return msgspec.to_builtins(sum_stats([msgspec.convert(r, SchedulerStats) for r in results]))
        if method == "reset_prefix_cache" and all(results) and self.router is not None:
            self.router.clear_prefixes()
        return _COMBINE[method](results)

    async def call_utility_each(self, method: str, *args: Any) -> list[Any]:
        """Call a utility method on every engine; the results by engine index."""
        self._check_alive()
        return list(await asyncio.gather(*(e.call_utility(method, *args) for e in self.engines)))

    async def get_output(self) -> CoreOutputBatch:
        """The next batch of outputs from any engine (its engine_index says which)."""
        assert self._queue is not None, "attach() the client to an event loop first"
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)  # every later read fails the same way
            raise item
        return item
