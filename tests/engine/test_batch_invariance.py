"""A request's greedy tokens do not depend on what else runs: batch size, chunking, block size, preemption."""

from __future__ import annotations

import pytest

from pagemill import LLM, SamplingParams
from tests.conftest import SMOL_PROMPTS, hf_greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def batch_prompts(smol_hf) -> list[list[int]]:
    """32 prompts of mixed lengths (about 5 to 250 tokens)."""
    tok = smol_hf[1]
    out = []
    for i in range(32):
        text = " ".join(SMOL_PROMPTS[(i + j) % len(SMOL_PROMPTS)] for j in range(1 + (i * 7) % 19))
        out.append(tok.encode(text))
    return out


@pytest.fixture(scope="module")
def reference(smol_llm, smol_hf, batch_prompts) -> dict[int, list[int]]:
    """Each target request run alone, checked against HF transformers."""
    targets = [0, 5, 13, 31]
    ref = {}
    for i in targets:
        out = smol_llm.generate({"prompt_token_ids": batch_prompts[i]}, GREEDY, use_tqdm=False)
        ref[i] = out[0].outputs[0].token_ids
        assert ref[i] == hf_greedy(smol_hf[0], batch_prompts[i], MAX_TOKENS)
    return ref


def _check(llm: LLM, prompts: list[list[int]], reference: dict[int, list[int]]) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for i, toks in reference.items():
        assert outs[i].outputs[0].token_ids == toks, f"request {i} changed in the batch"
    stats = llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total  # nothing leaked


def test_batch_of_32(smol_llm, batch_prompts, reference, kernel_isa):
    _check(smol_llm, batch_prompts, reference)


def test_chunked_prefill_forced(smol_path, batch_prompts, reference):
    llm = LLM(smol_path, max_num_batched_tokens=16, kv_cache_memory="256MiB", max_model_len=1024)
    _check(llm, batch_prompts, reference)


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes(smol_path, batch_prompts, reference, block_size):
    llm = LLM(smol_path, block_size=block_size, kv_cache_memory="256MiB", max_model_len=1024)
    _check(llm, batch_prompts, reference)


def test_preemption_and_recompute(smol_path, batch_prompts, reference):
    llm = LLM(smol_path, num_gpu_blocks_override=40, max_model_len=512, enable_prefix_caching=False)
    _check(llm, batch_prompts, reference)
    assert llm.get_stats().num_preemptions > 0


def test_preemption_by_swapping(smol_path, batch_prompts, reference):
    llm = LLM(smol_path, num_gpu_blocks_override=40, max_model_len=512, enable_prefix_caching=False,
              preemption_mode="swap", swap_space=0.05)
    _check(llm, batch_prompts, reference)
    stats = llm.get_stats()
    assert stats.num_swapped_out > 0
    assert stats.num_swap_blocks_free == stats.num_swap_blocks_total > 0  # every swapped block came back
