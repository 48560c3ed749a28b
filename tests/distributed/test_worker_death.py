"""A worker process killed mid-run fails the engine cleanly: in-flight requests error out within 5 s, the server's
/health turns 500, nothing hangs (offline LLM and AsyncLLM behind the HTTP server, TP=2 worker processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest
import uvicorn

from pagemill import LLM, SamplingParams
from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.async_llm import AsyncLLM, EngineDeadError
from pagemill.sampling_params import RequestOutputKind
from pagemill.entrypoints.openai.api_server import build_app
from pagemill.worker.multiproc_executor import WorkerDiedError
from tests.entrypoints.conftest import free_port

ENGINE = dict(tensor_parallel_size=2, kv_cache_memory="8MiB", max_model_len=512)
LONG = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)


def _spawned_children(pid: int) -> list[int]:
    """Ids of the multiprocessing-spawned processes whose parent is `pid` (from /proc; not its resource tracker)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                out.append(int(entry))
    return out


def test_offline_engine_fails_fast_when_a_worker_dies(tiny_llama):
    llm = LLM(tiny_llama, **ENGINE)
    executor = llm.llm_engine.engine_core.executor
    victim = executor.procs[1]
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(0.5)  # mid-run: the 8 x 480 tokens take ~2 s with shared-memory collectives (~7 s with gloo)
        killed_at.append(time.monotonic())
        os.kill(victim.pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    with pytest.raises(WorkerDiedError, match="worker rank 1"):
        llm.generate(["The capital of France is"] * 8, LONG, use_tqdm=False)
    assert killed_at and time.monotonic() - killed_at[0] < 5
    # every worker is gone (the survivor may have been stuck in a collective with the dead one)
    assert all(not p.is_alive() for p in executor.procs)


def test_server_fails_requests_and_health_when_a_worker_dies(tiny_llama):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, ["tiny"]), host="127.0.0.1", port=port,
                                           log_level="warning"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while not server.started and time.monotonic() < end:
            time.sleep(0.05)
        assert server.started
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        workers = _spawned_children(engine.client.pid)
        assert len(workers) == 2, workers
        first = asyncio.Event()

        async def collect() -> list:
            outs = []
            params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True,
                                    output_kind=RequestOutputKind.DELTA)
            async for out in engine.generate("The capital of France is", params, "doomed"):
                outs.append(out)
                loop.call_soon(first.set)
            return outs

        pending = asyncio.run_coroutine_threadsafe(collect(), loop)
        end = time.monotonic() + 60
        while not first.is_set() and time.monotonic() < end:
            time.sleep(0.02)
        assert first.is_set() and not pending.done()
        killed = time.monotonic()
        os.kill(max(workers), signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            pending.result(5)
        assert time.monotonic() - killed < 5
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 500
        engine.client.proc.join(10)
        assert not engine.client.proc.is_alive()
        assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()
        loop.close()


def test_idle_engine_health_check_sees_a_dead_worker(tiny_llama):
    """The core process checks its workers while idle (so /health fails without traffic): check_health raises."""
    llm = LLM(tiny_llama, **ENGINE)
    core = llm.llm_engine.engine_core
    core.check_health()
    victim = core.executor.procs[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(5)
    with pytest.raises(WorkerDiedError, match="worker rank 0"):
        core.check_health()
    assert all(not p.is_alive() for p in core.executor.procs)
    with pytest.raises(WorkerDiedError):
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
