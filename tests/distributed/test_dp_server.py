"""`pagemill serve -dp 2` as a subprocess, driven by the real `openai` client: the same greedy text as the
single-process engine, work on both engines, per-engine /metrics, and /health failing when an engine dies."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.conftest import RemoteServer, child_pids

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at",
           "The quick brown fox", "import numpy as np", "Dear Sir or Madam,", "In 1492,"]


def engine_core_pids(server_pid: int) -> list[int]:
    """The multiprocessing-spawned engine core children of a server."""
    pids = []
    for pid in child_pids(server_pid):
        try:
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                pids.append(pid)
        except FileNotFoundError:
            pass
    return pids


def total(m: dict[str, float], name: str) -> float:
    """A metric summed over its `engine` series (the PromQL `sum without (engine)`)."""
    return sum(v for k, v in m.items() if k.startswith(name + "{") and 'engine="' in k)


def wait_idle(server: RemoteServer, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until no engine runs or queues anything and every KV block is free."""
    end = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if (total(m, "pagemill:num_requests_running") == total(m, "pagemill:num_requests_waiting") == 0
                and total(m, "pagemill:kv_cache_free_blocks") == total(m, "pagemill:kv_cache_total_blocks") > 0):
            return m
        assert time.monotonic() < end, f"server not idle after {timeout_s}s: {m}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("dp_server") / "server.log"
    s = RemoteServer([tiny_llama, "-dp", "2", "--dp-routing", "least-loaded", "--served-model-name", "tiny",
                      "--kv-cache-memory", "16MiB", "--max-model-len", "512", "--disable-uvicorn-access-log"], log)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def test_openai_client_greedy_matches_single_process_and_both_engines_work(server, tiny_llama):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")

    async def one(prompt: str):
        return await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)

    async def all_at_once():
        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await client.close()

    responses = asyncio.run(all_at_once())

    from pagemill import LLM
    from pagemill.sampling_params import SamplingParams

    ref = LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=512)
    expected = ref.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [r.choices[0].text for r in responses] == [e.outputs[0].text for e in expected]

    m = wait_idle(server)
    per_engine = [m.get(f'pagemill:prompt_tokens_total{{engine="{i}"}}', 0.0) for i in range(2)]
    assert all(n > 0 for n in per_engine), per_engine  # a burst of 8 onto idle engines: 4 each
    assert sum(per_engine) == sum(r.usage.prompt_tokens for r in responses)
    assert sum(m.get(f'pagemill:request_success_total{{engine="{i}",finished_reason="length"}}', 0.0)
               for i in range(2)) == len(PROMPTS)
    assert m['pagemill:kv_cache_total_blocks{engine="0"}'] == m['pagemill:kv_cache_total_blocks{engine="1"}'] > 0


def test_reset_prefix_cache_and_health(server):
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=10).json() == {"success": True}
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_one_engine_dying_fails_the_server(server):
    """One engine's death fails the front end: /health stops answering 200 and the server exits non-zero (so that
    a supervisor restarts it), saying which engine died."""
    pids = engine_core_pids(server.proc.pid)
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGKILL)
    end = time.monotonic() + 5
    while True:
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code != 200:
                break
        except httpx.ConnectError:  # already gone
            break
        assert time.monotonic() < end, "/health still 200 five seconds after an engine died"
        time.sleep(0.05)
    assert server.proc.wait(30) not in (0, None)
    assert "Data-parallel engine" in server.log_tail(20000), server.log_tail()