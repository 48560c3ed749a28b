"""Pipeline-parallel micro-batching on real worker processes: with PP=2 the engine core keeps two batches in the
executor at once (each stage works on its own), and greedy output still equals the single-process engine's."""

from __future__ import annotations

from pagemill import LLM, SamplingParams
from pagemill.distributed import cleanup_dist_env_and_memory

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village, there lived",
           "Water boils at", "The quick brown fox", "1, 2, 3, 4,"]
ENGINE = dict(kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=16, seed=0)  # chunked prefills
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=1, ignore_eos=True)


def test_pp2_keeps_two_micro_batches_in_flight_and_matches_single_process(tiny_llama):
    want = LLM(tiny_llama, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(tiny_llama, pipeline_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    core = llm.llm_engine.engine_core
    try:
        assert core.batch_queue_size == 2
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert core.executor.steps.max_in_flight == 2
        assert not core.batch_queue and not core.scheduler.in_flight
        assert len(llm.apply_model(type)) == 2  # the pipes are in step after the queue drained
    finally:
        core.shutdown()
        cleanup_dist_env_and_memory()
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for gl, wl in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert all(abs(gl[t].logprob - wl[t].logprob) < 1e-4 for t in wl)
