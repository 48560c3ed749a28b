"""Fixtures of the scale-out tests: a second tiny random Llama whose shapes stress the splits."""

from __future__ import annotations

import pytest
import torch

from pagemill.loader.default_model import default_model_path


@pytest.fixture(scope="session")
def tiny_llama_gqa1(tmp_path_factory) -> str:
    """A tiny random Llama with one K/V head (replicated over tensor-parallel ranks), QKV and output biases, an
    untied LM head and 3 layers (an uneven pipeline split): SmolLM2's tokenizer, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagemill.benchmarks.model_path import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(default_model_path())
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=False, attention_bias=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    path = tmp_path_factory.mktemp("tiny_llama_gqa1")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
