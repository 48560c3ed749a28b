"""Greedy outputs must equal HF transformers token for token (float32), for every model family."""

from __future__ import annotations

import pytest
import torch

from pagemill import LLM, SamplingParams
from tests.conftest import SMOL_PROMPTS, hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_reference(smol_hf) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, HF greedy 64 tokens) for the SmolLM2 prompts, computed once for every kernel variant."""
    hf_model, tok = smol_hf
    prompts = [tok.encode(p) for p in SMOL_PROMPTS]
    return [(p, hf_greedy(hf_model, p, 64)) for p in prompts]


def test_smollm2_gguf_batch_matches_hf(smol_llm, smol_reference, kernel_isa):
    outs = smol_llm.generate([{"prompt_token_ids": p} for p, _ in smol_reference],
                             SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    for (p, ref), o in zip(smol_reference, outs):
        assert o.outputs[0].token_ids == ref, (kernel_isa, p)


def test_smollm2_chat_answer(smol_llm):
    out = smol_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0), use_tqdm=False)
    assert out[0].outputs[0].text == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3", "gemma3_text", "phi3"])
def test_tiny_random_models_match_hf(kind, tiny_models, smol_hf, kernel_isa):
    from transformers import AutoModelForCausalLM

    path = tiny_models[kind]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = smol_hf[1]
    prompts = [tok.encode(p) for p in SMOL_PROMPTS[:6]]
    llm = LLM(path, kv_cache_memory="64MiB", block_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24)
