"""Tensor, pipeline and tensor x pipeline parallel engines (real worker processes, gloo on loopback) give the
single-process engine's greedy tokens, and its logprobs within 1e-4, on tiny random float32 Llamas."""

from __future__ import annotations

import pytest

from pagemill import LLM, SamplingParams
from pagemill.distributed import cleanup_dist_env_and_memory

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village, there lived",
           "Water boils at"]
ENGINE = dict(kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=16, seed=0)  # chunked prefills
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
PROMPT_LP = SamplingParams(temperature=0, max_tokens=4, logprobs=1, prompt_logprobs=1, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=10, logprobs=0, ignore_eos=True)
UNSEEDED = SamplingParams(temperature=1.0, max_tokens=10, logprobs=0, ignore_eos=True)


def _run(llm: LLM) -> list:
    params = [GREEDY, PROMPT_LP, SEEDED, GREEDY, UNSEEDED]
    return llm.generate(PROMPTS + [PROMPTS[0]], params, use_tqdm=False)


def _assert_logprobs_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if g is None or w is None:
            assert g is None and w is None
            continue
        assert g.keys() == w.keys()
        for tok in g:
            assert abs(g[tok].logprob - w[tok].logprob) < 1e-4, (tok, g[tok], w[tok])


def _reference(model: str) -> tuple[list, LLM]:
    llm = LLM(model, **ENGINE)
    return _run(llm), llm


@pytest.mark.parametrize("model_fixture,tp,pp", [("tiny_llama", 2, 1), ("tiny_llama", 1, 2),
                                                 ("tiny_llama_gqa1", 2, 2)])
def test_parallel_matches_single_process(request, model_fixture, tp, pp):
    model = request.getfixturevalue(model_fixture)
    want, ref_llm = _reference(model)
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    try:
        assert llm.llm_engine.engine_core.executor.world_size == tp * pp
        got = _run(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        cleanup_dist_env_and_memory()
    for i in range(4):  # greedy, with prompt logprobs, seeded random: the same tokens, logprobs within 1e-4
        g, w = got[i].outputs[0], want[i].outputs[0]
        assert g.token_ids == w.token_ids, (i, g.token_ids, w.token_ids)
        _assert_logprobs_close(g.logprobs, w.logprobs)
    _assert_logprobs_close(got[1].prompt_logprobs, want[1].prompt_logprobs)
    # An unseeded random request: each rank samples its own token, the driver's must reach every rank (else the
    # other ranks' heads attend over different tokens). Teacher-forcing its tokens through the single-process
    # engine gives the logprobs the parallel engine reported for them.
    out = got[4].outputs[0]
    assert len(out.token_ids) == UNSEEDED.max_tokens
    forced = ref_llm.generate({"prompt_token_ids": got[4].prompt_token_ids + out.token_ids},
                              SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    n = len(got[4].prompt_token_ids)
    for j, tok in enumerate(out.token_ids):
        assert abs(forced.prompt_logprobs[n + j][tok].logprob - out.logprobs[j][tok].logprob) < 1e-4, j


@pytest.mark.slow
def test_gguf_decoded_to_float_tp3_matches_single_process(smol_path):
    """SmolLM2's GGUF (9 heads, 3 K/V heads, vocabulary 49152) over 3 tensor-parallel ranks: its lazy GGUF weights
    are decoded, then sliced (quantization='none'); the same tokens and logprobs as one process."""
    engine = dict(kv_cache_memory="64MiB", max_model_len=512, quantization="none")
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = PROMPTS[:2]
    want = LLM(smol_path, **engine).generate(prompts, params, use_tqdm=False)
    llm = LLM(smol_path, tensor_parallel_size=3, **engine)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        _assert_logprobs_close(g.outputs[0].logprobs, w.outputs[0].logprobs)
