"""A decoder model as an embedder (runner="pooling"): last-token and mean pooling of the hidden states after the
final norm equal HF's, with chunked prefill across steps."""

from __future__ import annotations

import os

import pytest
import torch

from pagemill import LLM, PoolingParams
from tests.pooling.conftest import cosines, hf_sentence_embedding


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, minilm_hf):
    """(path, HF LlamaModel) of a tiny random Llama saved by transformers (MiniLM's tokenizer)."""
    from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig

    tok = minilm_hf[1]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, rope_theta=10000.0)
    path = os.path.join(str(tmp_path_factory.mktemp("llama")), "tiny-llama")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path, AutoModel.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_pooled_hidden_states_match_hf(tiny_llama, minilm_hf, texts, pooling):
    path, hf = tiny_llama
    tok = minilm_hf[1]
    # a 24-token budget: the longer prompts are computed in several chunks, their pools added up across steps
    llm = LLM(path, runner="pooling", pooler_config={"pooling_type": pooling}, max_num_batched_tokens=24,
              kv_cache_memory="16MiB")
    assert not llm.llm_engine.config.cache_config.enable_prefix_caching
    sample = texts[:30]
    outs = llm.embed(sample, use_tqdm=False)
    refs = [hf_sentence_embedding(hf, tok, t, pooling=pooling) for t in sample]
    assert cosines([o.outputs.embedding for o in outs], refs).min() >= 0.99999
    raw = llm.embed(sample[:5], PoolingParams(normalize=False), use_tqdm=False)
    raw_refs = [hf_sentence_embedding(hf, tok, t, normalize=False, pooling=pooling) for t in sample[:5]]
    assert torch.allclose(torch.tensor([o.outputs.embedding for o in raw]), torch.stack(raw_refs), atol=1e-4)
    stats = llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total and stats.num_generation_tokens == 0


def test_generate_model_rejects_pooling_and_vice_versa(tiny_llama):
    path, _ = tiny_llama
    gen = LLM(path, kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="^pooling_params: this model generates text"):
        gen.embed("hello", use_tqdm=False)
    assert gen.generate("hello", use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(path, runner="pooling", speculative_config={"method": "ngram"})


@pytest.mark.slow
def test_smollm2_last_token_embeddings_match_hf(smol_path, smol_hf):
    """The embedded SmolLM2 (GGUF, dequantized) as an embedder, against HF's hidden states of the same GGUF."""
    model, tok = smol_hf
    llm = LLM(smol_path, runner="pooling", kv_cache_memory="256MiB", max_model_len=512)
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at 100 degrees Celsius."]
    outs = llm.embed(prompts, use_tqdm=False)
    refs = []
    for p in prompts:
        with torch.inference_mode():
            h = model.model(torch.tensor([tok.encode(p)])).last_hidden_state[0, -1]
        refs.append(torch.nn.functional.normalize(h.float(), dim=-1))
    assert cosines([o.outputs.embedding for o in outs], refs).min() >= 0.9999
