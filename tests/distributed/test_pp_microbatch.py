"""Pipeline-parallel micro-batching on real worker processes: with PP=2 the engine core keeps two batches in the
executor at once (each stage works on its own), and greedy output still equals the single-process engine's, also
when a request is aborted and the model is called while both batches are in flight."""

from __future__ import annotations

import pytest

from pagemill import LLM, SamplingParams
from pagemill.distributed import cleanup_dist_env_and_memory

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village, there lived",
           "Water boils at", "The quick brown fox", "1, 2, 3, 4,"]
ENGINE = dict(kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=16, seed=0)  # chunked prefills
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """(the single-process engine, a PP=2 engine on worker processes)."""
    ref = LLM(tiny_llama, **ENGINE)
    llm = LLM(tiny_llama, pipeline_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    yield ref, llm
    llm.llm_engine.engine_core.shutdown()
    cleanup_dist_env_and_memory()


def test_pp2_keeps_two_micro_batches_in_flight_and_matches_single_process(engines):
    ref, llm = engines
    want = ref.generate(PROMPTS, GREEDY, use_tqdm=False)
    core = llm.llm_engine.engine_core
    assert core.batch_queue_size == 2
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert core.executor.steps.max_in_flight == 2
    assert not core.batch_queue and not core.scheduler.in_flight
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for gl, wl in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert all(abs(gl[t].logprob - wl[t].logprob) < 1e-4 for t in wl)


def test_abort_and_apply_model_with_two_batches_in_flight(engines):
    ref, llm = engines
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = {f"q{i}": o.outputs[0].token_ids for i, o in enumerate(ref.generate(PROMPTS, params, use_tqdm=False))}
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"q{i}", prompt, params)
    done = {}
    while len(core.batch_queue) < 2:  # until two batches are in the pipeline
        done.update({o.request_id: o for o in engine.step() if o.finished})
    first = set(core.batch_queue[0][1].num_scheduled_tokens)
    second = set(core.batch_queue[1][1].num_scheduled_tokens)
    assert first and second and not first & second
    assert len(llm.apply_model(type)) == 2  # the driver's pending outputs are read first, kept for the queue
    aborted = sorted(first)[0]
    engine.abort_request([aborted])
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert aborted not in done and set(done) == set(want) - {aborted}
    for rid, out in done.items():
        assert out.outputs[0].token_ids == want[rid], rid


def test_pipeline_micro_batching_off_runs_one_batch_at_a_time(tiny_llama, engines):
    """`pipeline_micro_batching=False` (the A/B baseline of `bench --variant`): one batch in flight, same tokens."""
    from pagemill.engine.arg_utils import EngineArgs

    ref, _ = engines
    want = ref.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(tiny_llama, pipeline_parallel_size=2, distributed_executor_backend="mp", pipeline_micro_batching=False,
              **ENGINE)
    try:
        core = llm.llm_engine.engine_core
        assert core.batch_queue_size == 1 and core.batch_queue is None and core.scheduler.max_concurrent_batches == 1
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert core.executor.steps.max_in_flight == 1
        assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    finally:
        llm.llm_engine.engine_core.shutdown()
    with pytest.raises(ValueError, match="pipeline_micro_batching"):
        EngineArgs(model=tiny_llama, pipeline_micro_batching="yes").create_engine_config()
