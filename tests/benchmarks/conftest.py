"""Shared fixtures for the benchmark tests: the embedded model's real tokenizer."""

import pytest

from pagemill.benchmarks.model_path import default_model_path, load_hf_tokenizer


@pytest.fixture(scope="session")
def default_model() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF."""
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_model):
    """The default model's real Hugging Face tokenizer (loaded once)."""
    return load_hf_tokenizer(default_model)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer) -> str:
    """A 2-layer random Llama with the default model's tokenizer, saved as an HF directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
