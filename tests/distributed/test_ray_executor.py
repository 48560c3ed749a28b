"""The `ray` executor on a local Ray instance (real actors, gloo on loopback): TP=2 gives the single-process engine's
greedy tokens and logprobs, a killed actor fails the engine within 5 s, and PP=2 keeps two micro-batches in flight
with the same tokens. (Two real nodes: test_ray_two_nodes.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pagemill import LLM, SamplingParams
from pagemill.worker.multiproc_executor import WorkerDiedError

ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray)")

ENGINE = dict(kv_cache_memory="8MiB", max_model_len=512)
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _pid(model) -> int:
    return os.getpid()


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_tp2_matches_single_process_and_fails_fast_on_a_dead_actor(local_ray, tiny_llama):
    want = LLM(tiny_llama, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    core = llm.llm_engine.engine_core
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for gl, wl in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert gl.keys() == wl.keys()
            assert all(abs(gl[t].logprob - wl[t].logprob) < 1e-4 for t in gl)
    pids = llm.apply_model(_pid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    core.check_health()
    killed_at: list[float] = []

    def kill() -> None:  # (the generation below runs for several seconds: 48 requests of 480 tokens)
        time.sleep(0.5)
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    with pytest.raises(WorkerDiedError):
        llm.generate(PROMPTS * 12, SamplingParams(temperature=0, max_tokens=480, ignore_eos=True), use_tqdm=False)
    assert killed_at and time.monotonic() - killed_at[0] < 5
    with pytest.raises(WorkerDiedError):
        core.check_health()


def test_ray_pp2_keeps_two_micro_batches_in_flight(local_ray, tiny_llama):
    engine = dict(ENGINE, max_num_batched_tokens=16)  # chunked prefills too
    prompts = PROMPTS + ["Water boils at", "1, 2, 3"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = LLM(tiny_llama, **engine).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_llama, pipeline_parallel_size=2, distributed_executor_backend="ray", **engine)
    core = llm.llm_engine.engine_core
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert core.executor.steps.max_in_flight == 2
    finally:
        core.shutdown()
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
