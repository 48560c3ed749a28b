"""AsyncLLM used from Python (no HTTP), next to an in-process HTTP server; then the engine core is killed."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.async_llm import AsyncLLM, EngineDeadError
from pagemill.entrypoints.openai.api_server import build_app
from pagemill.sampling_params import RequestOutputKind, SamplingParams
from tests.entrypoints.conftest import free_port

PROMPT = "The capital of France is"


@dataclass
class Live:
    """An AsyncLLM, the event loop its server runs on, and the server's URL."""

    engine: AsyncLLM
    loop: asyncio.AbstractEventLoop
    url: str

    def run(self, coro, timeout: float = 120.0):
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="module")
def live():
    engine = AsyncLLM.from_engine_args(EngineArgs(kv_cache_memory="128MiB", max_model_len=1024))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, ["smol"]), host="127.0.0.1", port=port,
                                           log_level="warning"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    end = time.monotonic() + 60
    while not server.started and time.monotonic() < end:
        time.sleep(0.05)
    assert server.started
    try:
        yield Live(engine, loop, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()
        loop.close()
    assert not engine.client.proc.is_alive()


async def _collect(engine: AsyncLLM, request_id: str, params: SamplingParams, prompt=PROMPT) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


async def _wait_free(engine: AsyncLLM, timeout_s: float = 30.0) -> dict:
    end = time.monotonic() + timeout_s
    while True:
        stats = await engine.get_scheduler_stats()
        idle = stats.get("num_running_reqs", 0) == 0 and stats.get("num_waiting_reqs", 0) == 0
        if idle and stats["num_blocks_free"] == stats["num_blocks_total"]:
            return stats
        assert time.monotonic() < end, stats
        await asyncio.sleep(0.05)


def test_delta_and_final_outputs_agree(live):
    final = live.run(_collect(live.engine, "final", SamplingParams(temperature=0, max_tokens=6)))
    delta = live.run(_collect(live.engine, "delta", SamplingParams(temperature=0, max_tokens=6,
                                                                   output_kind=RequestOutputKind.DELTA)))
    assert len(final) == 1 and final[0].finished
    assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
    assert "".join(o.outputs[0].text for o in delta) == final[0].outputs[0].text
    assert sum(len(o.outputs[0].token_ids) for o in delta) == len(final[0].outputs[0].token_ids)
    m = final[0].metrics  # first_scheduled_time comes from the core's SCHEDULED event
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    # the same greedy text over HTTP
    r = httpx.post(live.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0},
                   timeout=120)
    assert r.json()["choices"][0]["text"] == final[0].outputs[0].text


def test_kv_cache_config_comes_from_the_core_process(live):
    kv = live.engine.client.kv_cache_config  # sent in the core's READY message
    stats = live.run(_wait_free(live.engine))
    assert kv.block_size == 16 and kv.num_swap_blocks == 0
    assert stats["num_blocks_total"] == kv.usable_blocks > 0


def test_n2_and_duplicate_request_id(live):
    async def run():
        outs = await _collect(live.engine, "n2", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6))
        live.engine.add_request("dup", PROMPT, SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="already in use"):
            live.engine.add_request("dup", PROMPT, SamplingParams(max_tokens=4))
        await live.engine.abort("dup")
        return outs

    outs = live.run(run())
    assert len(outs) == 1 and sorted(c.index for c in outs[0].outputs) == [0, 1]
    live.run(_wait_free(live.engine))


def test_invalid_params_raise_value_error(live):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(live.engine, "long", SamplingParams(max_tokens=4), prompt=[1] * 2000)

    live.run(run())


def test_abort_ends_stream_and_frees_blocks(live):
    async def run():
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        seen = []
        async for out in live.engine.generate(PROMPT, params, "to-abort"):
            seen.append(out)
            if len(seen) == 3:
                await live.engine.abort("to-abort")
        return seen, await _wait_free(live.engine)

    seen, stats = live.run(run())
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_consumer_leaving_early_aborts(live):
    async def run():
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        gen = live.engine.generate(PROMPT, params, "leaver")
        await anext(gen)
        await gen.aclose()
        return await _wait_free(live.engine)

    stats = live.run(run())
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_stop_string_aborts_in_core(live):
    async def run():
        full = await _collect(live.engine, "full", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        text = full[0].outputs[0].text
        stop = text.split()[1]
        before = await _wait_free(live.engine)
        cut = await _collect(live.engine, "cut", SamplingParams(temperature=0, max_tokens=300, ignore_eos=True,
                                                                stop=[stop]))
        return text, stop, cut, before, await _wait_free(live.engine, 5)

    text, stop, cut, before, after = live.run(run())
    assert cut[-1].outputs[0].text == text[:text.index(stop)]
    assert cut[-1].outputs[0].finish_reason == "stop" and cut[-1].outputs[0].stop_reason == stop
    # the core stopped right after the match instead of generating 300 tokens
    assert after["num_generation_tokens"] - before["num_generation_tokens"] <= len(cut[-1].outputs[0].token_ids) + 3


def test_reset_prefix_cache_when_idle(live):
    assert live.run(live.engine.reset_prefix_cache()) is True


def test_engine_death_fails_requests_and_health(live):
    """Kill the core: a pending Python generate raises, a live HTTP stream ends with a 500 event, /health is 500."""
    lines: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 900, "stream": True,
                "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    pending = asyncio.run_coroutine_threadsafe(
        _collect(live.engine, "doomed", SamplingParams(max_tokens=900, ignore_eos=True)), live.loop)
    assert first_chunk.wait(60)
    os.kill(live.engine.client.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        pending.result(30)
    reader.join(30)
    assert not reader.is_alive()
    assert lines[-1] == "data: [DONE]" and '"code": 500' in lines[-2]
    assert live.engine.errored and not live.engine.is_running
    health = httpx.get(live.url + "/health", timeout=10)
    assert health.status_code == 500 and health.json()["error"]["code"] == 500
    t0 = time.monotonic()
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]},
                   timeout=30)
    assert r.status_code == 500 and "dead" in r.json()["error"]["message"].lower()
    assert time.monotonic() - t0 < 5
    with pytest.raises(EngineDeadError):
        live.run(_collect(live.engine, "after", SamplingParams(max_tokens=2)))
