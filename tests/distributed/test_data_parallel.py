"""Data parallelism with real engine core processes (tiny random Llama): DP=2 output equals the single-process
engine, routing spreads the load, aborts and utility calls reach the right engines, prefix affinity raises the
prefix-cache hit rate, and an engine's death fails the whole front end."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.async_llm import AsyncLLM, EngineDeadError, RequestOutputCollector
from pagemill.outputs import RequestOutput
from pagemill.sampling_params import SamplingParams

MAX_MODEL_LEN = 512


class LoopThread:
    """An event loop in a thread, so that the tests can stay synchronous (as a server's loop would)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        """Run a coroutine on the loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _engine(tiny_llama: str, routing: str) -> AsyncLLM:
    return AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, data_parallel_size=2, dp_routing=routing,
                                                kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def dp2(tiny_llama, loop):
    """AsyncLLM over two engine cores, least-loaded routing (the last test of the module kills one)."""
    engine = _engine(tiny_llama, "least-loaded")
    yield engine
    engine.shutdown()
    assert not any(e.proc.is_alive() for e in engine.client.engines)


async def _drain(collector: RequestOutputCollector) -> RequestOutput:
    out = await collector.get()
    while not out.finished:
        out = await collector.get()
    return out


async def _wave(engine: AsyncLLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[RequestOutput]:
    """Add every prompt at once (one burst the router sees whole), then wait for all of them."""
    collectors = [engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(prompts)]
    return list(await asyncio.gather(*(_drain(c) for c in collectors)))


def _stats(loop: LoopThread, engine: AsyncLLM) -> list[dict[str, Any]]:
    return loop.run(engine.get_engine_stats())


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 40000) for _ in range(n)]


def test_greedy_output_equals_single_process(dp2, loop, tiny_llama):
    rng = random.Random(0)
    prompts = [_tokens(rng, n) for n in (5, 17, 33, 8, 64, 3, 40, 21)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = _stats(loop, dp2)
    outs = loop.run(_wave(dp2, prompts, params, "greedy"))
    after = _stats(loop, dp2)

    from pagemill import LLM

    ref = LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    expected = ref.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [e.outputs[0].token_ids for e in expected]
    # both engines computed a share of the batch (least-loaded: 4 each in a burst onto idle engines)
    prompt_tokens = [a["num_prompt_tokens"] - b.get("num_prompt_tokens", 0) for a, b in zip(after, before)]
    assert all(n > 0 for n in prompt_tokens) and sum(prompt_tokens) == sum(map(len, prompts))


def test_engines_are_pinned_to_their_share_of_the_cores(dp2):
    cpus = sorted(os.sched_getaffinity(0))
    shares = [sorted(os.sched_getaffinity(pid)) for pid in dp2.client.pids]
    if len(cpus) >= 2:  # disjoint halves
        assert shares == [cpus[:len(cpus) // 2], cpus[len(cpus) // 2:2 * (len(cpus) // 2)]]
    else:
        assert shares == [cpus, cpus]


def test_offline_llm_with_data_parallel_size(tiny_llama):
    """LLM(data_parallel_size=2): the same greedy tokens as LLM(), computed by two engine core processes."""
    from pagemill import LLM

    rng = random.Random(5)
    prompts = [{"prompt_token_ids": _tokens(rng, n)} for n in (7, 30, 12, 50)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN).generate(prompts, params,
                                                                                           use_tqdm=False)
    llm = LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN, data_parallel_size=2)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_stats()
        engines = llm.llm_engine.engine_core.client.last_stats
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [e.outputs[0].token_ids for e in expected]
    assert stats.num_generation_tokens == 40 and stats.num_prompt_tokens == 99
    assert all(s is not None and s.num_generation_tokens > 0 for s in engines)  # both engines decoded


def test_abort_reaches_the_engine_that_runs_the_request(dp2, loop):
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True)

    async def run() -> tuple[dict[str, int], list[dict], list[dict], list[RequestOutput]]:
        before = await dp2.get_engine_stats()
        collectors = [dp2.add_request(f"long-{i}", {"prompt_token_ids": _tokens(rng, 8)}, params) for i in range(2)]
        engine_of = dict(dp2.client.engine_of)
        await dp2.abort("long-0")  # it queues behind its ADD on the same engine's socket
        outs = await asyncio.gather(*(_drain(c) for c in collectors))
        end = time.monotonic() + 10
        while True:  # wait for the engines to report the abort and the end of the other request
            after = await dp2.get_engine_stats()
            if all(s.get("num_running_reqs", 0) == 0 for s in after) or time.monotonic() > end:
                return engine_of, before, after, outs
            await asyncio.sleep(0.01)

    engine_of, before, after, outs = loop.run(run())
    assert sorted(engine_of.values()) == [0, 1]  # one on each engine
    victim, other = engine_of["long-0"], engine_of["long-1"]
    generated = [a["num_generation_tokens"] - b.get("num_generation_tokens", 0) for a, b in zip(after, before)]
    # the victim's engine dropped it (a misrouted abort would have let it generate all its 496 tokens; how many it
    # made before the abort arrived depends on the machine's speed, a few dozen on a fast one)
    assert generated[victim] < params.max_tokens // 4
    assert after[victim]["num_blocks_free"] == after[victim]["num_blocks_total"]
    assert outs[0].outputs[0].finish_reason == "abort"
    # and the other engine's request ran to its end untouched
    assert generated[other] == params.max_tokens
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == params.max_tokens


def test_reset_prefix_cache_fans_out_to_every_engine(dp2, loop):
    rng = random.Random(2)
    prompts = [_tokens(rng, 64), _tokens(rng, 64)]  # 4 blocks each; the burst puts one on each engine
    params = SamplingParams(temperature=0, max_tokens=2)

    def hits_of_wave(tag: str) -> list[int]:
        before = _stats(loop, dp2)
        loop.run(_wave(dp2, prompts, params, tag))
        after = _stats(loop, dp2)
        return [a.get("prefix_cache_hits", 0) - b.get("prefix_cache_hits", 0) for a, b in zip(after, before)]

    assert hits_of_wave("cold") == [0, 0]
    assert hits_of_wave("warm") == [48, 48]  # 3 full blocks each (the last prompt token is always computed)
    assert loop.run(dp2.reset_prefix_cache()) is True
    assert hits_of_wave("reset") == [0, 0]  # both caches were dropped, not only the first engine's


def test_n_siblings_share_one_engine(dp2, loop):
    """n > 1: the siblings fork the first one's prompt blocks, so they must land on its engine."""
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    rng = random.Random(6)

    async def run() -> tuple[dict[str, int], RequestOutput]:
        collectors = [dp2.add_request(f"fan-{i}", {"prompt_token_ids": _tokens(rng, 40)}, params) for i in range(2)]
        routes = dict(dp2.client.engine_of)
        outs = await asyncio.gather(*(_drain(c) for c in collectors))
        return routes, outs

    routes, outs = loop.run(run())
    assert len(routes) == 6
    for out in outs:
        engines = {i for sid, i in routes.items() if sid.endswith(out.request_id)}
        assert len(engines) == 1, routes
        assert len(out.outputs) == 3 and all(len(c.token_ids) == 6 for c in out.outputs)


def _shared_prefix_hits(engine: AsyncLLM, loop: LoopThread) -> tuple[int, int]:
    """4 prefixes of 4 blocks, 4 waves of one request per prefix in shuffled order: (hits, queries) in tokens."""
    rng = random.Random(3)
    prefixes = [_tokens(rng, 64) for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=2)
    before = _stats(loop, engine)
    for wave in range(4):
        order = list(range(4))
        rng.shuffle(order)
        loop.run(_wave(engine, [prefixes[p] + _tokens(rng, 8) for p in order], params, f"shared-{wave}"))
    after = _stats(loop, engine)

    def delta(key: str) -> int:
        return sum(a.get(key, 0) - b.get(key, 0) for a, b in zip(after, before))

    return delta("prefix_cache_hits"), delta("prefix_cache_queries")


def test_prefix_affinity_beats_least_loaded_on_shared_prefixes(dp2, loop, tiny_llama):
    least_hits, least_queries = _shared_prefix_hits(dp2, loop)
    affinity = _engine(tiny_llama, "prefix-affinity")
    try:
        hits, queries = _shared_prefix_hits(affinity, loop)
        prompt_tokens = [s["num_prompt_tokens"] for s in _stats(loop, affinity)]
    finally:
        affinity.shutdown()
    assert queries == least_queries == 16 * 72
    # affinity: every request after the first wave finds its whole 64-token prefix on its engine
    assert hits == 12 * 64
    # least-loaded spread each prefix over both engines, which computed it once each
    assert least_hits < hits
    assert all(n > 0 for n in prompt_tokens)  # affinity still used both engines


def test_engine_death_fails_every_request(dp2, loop):
    rng = random.Random(4)
    params = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True)

    async def run() -> tuple[list[BaseException | RequestOutput], float]:
        collectors = [dp2.add_request(f"doomed-{i}", {"prompt_token_ids": _tokens(rng, 8)}, params)
                      for i in range(8)]
        os.kill(dp2.client.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*(_drain(c) for c in collectors), return_exceptions=True), 5)
        return results, time.monotonic() - t0

    results, elapsed = loop.run(run())
    # the requests on the surviving engine fail too: the front end serves through all engines or none
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert elapsed < 5
    assert dp2.errored and not dp2.is_running
    assert "Data-parallel engine 1" in str(dp2.dead_error)
    with pytest.raises(EngineDeadError):
        dp2.add_request("after", "Hi", params)
