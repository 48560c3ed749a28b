"""Greedy output with speculative decoding is token-identical to greedy output without it: every method, k = 1..8,
batch 1 and 32, chunked prefill, forced preemption (recompute and swap), prefix caching, n > 1."""

from __future__ import annotations

import pytest

from pagemill import LLM, SamplingParams
from tests.conftest import SMOL_PROMPTS

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
REPEAT = ("Repeat the following text exactly.\nText: The committee met on Tuesday to review the budget. It approved "
          "the new library, delayed the road repairs and asked for a report on the park.\nRepeated text: The committee")
# Speculation stays on at every batch size in these tests (the default backs off from 8 running requests).
ALWAYS = {"max_batch_size": 1000, "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module")
def prompts(smol_hf) -> list[list[int]]:
    """32 prompts: repetitive ones (drafts get accepted) and free ones (drafts get rejected), 5 to ~200 tokens."""
    tok = smol_hf[1]
    out = []
    for i in range(32):
        if i % 3 == 0:
            text = REPEAT
        else:
            text = " ".join(SMOL_PROMPTS[(i + j) % len(SMOL_PROMPTS)] for j in range(1 + (i * 5) % 11))
        out.append(tok.encode(text))
    return out


@pytest.fixture(scope="module")
def reference(smol_llm, prompts) -> list[list[int]]:
    """Greedy tokens of every prompt without speculation."""
    outs = smol_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _check(llm: LLM, prompts: list[list[int]], reference: list[list[int]], indices: list[int]) -> None:
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in indices], GREEDY, use_tqdm=False)
    for i, out in zip(indices, outs):
        assert out.outputs[0].token_ids == reference[i], f"prompt {i} differs with speculation"
    stats = llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total  # nothing leaked


def _spec(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding


@pytest.mark.parametrize("k", range(1, 9))
def test_ngram_every_k_batch_1(smol_path, prompts, reference, k):
    llm = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": k, **ALWAYS})
    for i in (0, 1, 3):
        _check(llm, prompts, reference, [i])
    spec = _spec(llm)
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
    assert len(spec.num_accepted_tokens_per_pos) == k


METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6},
    "draft_layers": {"method": "draft_model", "draft_num_layers": 12, "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("method", list(METHODS))
def test_batch_32_chunked_prefill_and_preemption(smol_path, prompts, reference, method):
    """32 requests at once, 48-token steps (chunked prefill), a KV cache too small for all of them (preemption)."""
    llm = LLM(smol_path, num_gpu_blocks_override=40, max_model_len=512, max_num_batched_tokens=48,
              enable_prefix_caching=False, speculative_config={**METHODS[method], **ALWAYS})
    _check(llm, prompts, reference, list(range(32)))
    assert llm.get_stats().num_preemptions > 0
    assert _spec(llm).num_accepted_tokens > 0


@pytest.mark.parametrize("k", [1, 8])
def test_suffix_and_draft_model_batch_1(smol_path, prompts, reference, k):
    for cfg in ({"method": "suffix"}, {"method": "draft_model", "draft_num_layers": 20}):
        llm = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024,
                  speculative_config={**cfg, "num_speculative_tokens": k, **ALWAYS})
        for i in (0, 2):
            _check(llm, prompts, reference, [i])
        assert _spec(llm).num_draft_tokens > 0


def test_separate_draft_model_the_target_itself_accepts_everything(smol_path, prompts, reference):
    """The target as its own (separate) draft model: its own KV cache, and every draft token is accepted."""
    llm = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024,
              speculative_config={"method": "draft_model", "model": smol_path, "num_speculative_tokens": 4, **ALWAYS})
    _check(llm, prompts, reference, [0, 1, 2, 4, 5])
    spec = _spec(llm)
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens


def test_tiny_random_draft_model_with_preemption_by_swap(smol_path, tiny_models, prompts, reference):
    """A tiny random Llama (SmolLM2's tokenizer) drafting for SmolLM2, requests swapped out and back in."""
    llm = LLM(smol_path, num_gpu_blocks_override=60, max_model_len=512, enable_prefix_caching=False,
              preemption_mode="swap", swap_space=0.05,
              speculative_config={"method": "draft_model", "model": tiny_models["llama"], "num_speculative_tokens": 2,
                                  **ALWAYS})
    _check(llm, prompts, reference, list(range(16)))
    assert llm.get_stats().num_preemptions > 0


def test_prefix_caching_and_parallel_sampling(smol_path, prompts, reference):
    """Shared prefixes hit the cache with drafts in flight; n = 2 greedy siblings both equal the reference."""
    llm = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": 5, **ALWAYS})
    _check(llm, prompts, reference, [0, 3, 6, 9])  # the same prompt four times: prefix hits
    assert llm.get_stats().prefix_cache_hits > 0
    outs = llm.generate({"prompt_token_ids": prompts[0]},
                        SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs[0].outputs] == [reference[0], reference[0]]


def test_stop_inside_accepted_drafts_and_max_tokens(smol_path, prompts, reference):
    """A stop token among the accepted drafts ends the output there; max_tokens is never exceeded."""
    llm = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": 8, **ALWAYS})
    ref = reference[0]
    stop = ref[20]
    first = ref.index(stop)
    out = llm.generate({"prompt_token_ids": prompts[0]},
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[:first + 1]
    for m in (1, 2, 7, 13):
        out = llm.generate({"prompt_token_ids": prompts[0]},
                           SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == ref[:m]
    stats = llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total


def test_sliding_window_target(tiny_models):
    """Gemma 3 (sliding-window and full layers: two KV cache groups) with n-gram and own-layers drafts."""
    path = tiny_models["gemma3_text"]
    prompts = [[5 + (i * 7 + j) % 40 for j in range(30)] * 2 for i in range(6)]
    ref = LLM(path, max_model_len=512, kv_cache_memory="64MiB").generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for cfg in ({"method": "ngram", "num_speculative_tokens": 4}, {"method": "draft_model", "draft_num_layers": 1}):
        llm = LLM(path, max_model_len=512, kv_cache_memory="64MiB", speculative_config={**cfg, **ALWAYS})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        assert _spec(llm).num_draft_tokens > 0
