"""Scoring: embedding-cosine scores with all-MiniLM-L6-v2 and cross-encoder scores with a tiny random
BertForSequenceClassification, against HF; pairing rules and token types."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill import LLM, ScoringRequestOutput
from tests.pooling.conftest import hf_sentence_embedding, save_tiny_bert

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "The Eiffel Tower is in Paris.",
    "Bananas are rich in potassium.",
    "Berlin is the capital of Germany.",
    "France is a country in Western Europe; its capital is Paris.",
    "Cats sleep for most of the day.",
]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, minilm_hf):
    """(pagemill LLM, HF model, tokenizer) of a tiny random BERT cross-encoder with MiniLM's tokenizer."""
    from transformers import AutoModelForSequenceClassification

    tok = minilm_hf[1]
    path = save_tiny_bert(str(tmp_path_factory.mktemp("cross")), tok, classifier=True)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    return LLM(path), hf, tok


def hf_pair_logits(hf, tok, pairs: list[tuple[str, str]]) -> torch.Tensor:
    enc = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
    with torch.inference_mode():
        return hf(**enc).logits[:, 0]


def test_embedding_cosine_scores_match_hf(minilm_llm, minilm_hf):
    model, tok = minilm_hf
    outs = minilm_llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert all(isinstance(o, ScoringRequestOutput) for o in outs)
    scores = torch.tensor([o.outputs.score for o in outs])
    q = hf_sentence_embedding(model, tok, QUERY)
    ref = torch.stack([q @ hf_sentence_embedding(model, tok, d) for d in DOCUMENTS])
    assert torch.allclose(scores, ref, atol=1e-5)
    assert torch.argsort(scores, descending=True).tolist() == torch.argsort(ref, descending=True).tolist()
    assert outs[0].outputs.score > outs[2].outputs.score  # Paris beats bananas
    # N x N pairs are zipped; a one-element list broadcasts like a string
    zipped = minilm_llm.score([QUERY, DOCUMENTS[2]], [DOCUMENTS[0], DOCUMENTS[2]], use_tqdm=False)
    assert zipped[0].outputs.score == pytest.approx(outs[0].outputs.score, abs=1e-6)
    assert zipped[1].outputs.score == pytest.approx(1.0, abs=1e-5)
    one = minilm_llm.score([QUERY], DOCUMENTS[:2], use_tqdm=False)
    assert [o.outputs.score for o in one] == pytest.approx([o.outputs.score for o in outs[:2]], abs=1e-6)
    with pytest.raises(ValueError, match="text_1 has 2 items and text_2 3"):
        minilm_llm.score([QUERY, QUERY], DOCUMENTS[:3], use_tqdm=False)


def test_cross_encoder_scores_match_hf_logits(cross_encoder):
    llm, hf, tok = cross_encoder
    pairs = [(QUERY, d) for d in DOCUMENTS]
    logits = hf_pair_logits(hf, tok, pairs)
    outs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    scores = torch.tensor([o.outputs.score for o in outs])
    assert torch.allclose(scores, torch.sigmoid(logits), atol=1e-5)
    assert torch.argsort(scores, descending=True).tolist() == torch.argsort(logits, descending=True).tolist()
    # the pair's token types reach the model: segment 1 on the second text, as the HF tokenizer makes them
    enc = tok(QUERY, DOCUMENTS[0])
    assert outs[0].prompt_token_ids == enc["input_ids"]
    assert llm.llm_engine.config.model_config.pooler_config.head == "classify"


def test_cross_encoder_token_types_matter(cross_encoder):
    """Scoring the same ids with all-zero token types gives HF's all-zero-types logit, not the pair's."""
    llm, hf, tok = cross_encoder
    enc = tok(QUERY, DOCUMENTS[1])
    ids = enc["input_ids"]
    typed, untyped = llm.classify([{"prompt_token_ids": ids, "token_type_ids": enc["token_type_ids"]},
                                   {"prompt_token_ids": ids}], use_tqdm=False)
    with torch.inference_mode():
        ref_typed = hf(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([enc["token_type_ids"]])).logits
        ref_zero = hf(input_ids=torch.tensor([ids]), token_type_ids=torch.zeros(1, len(ids), dtype=torch.long)).logits
    assert typed.outputs.probs[0] == pytest.approx(torch.sigmoid(ref_typed)[0, 0].item(), abs=1e-5)
    assert untyped.outputs.probs[0] == pytest.approx(torch.sigmoid(ref_zero)[0, 0].item(), abs=1e-5)
    assert abs(typed.outputs.probs[0] - untyped.outputs.probs[0]) > 1e-4


def test_cross_encoder_batch_and_truncation(cross_encoder):
    llm, hf, tok = cross_encoder
    long_doc = " ".join(DOCUMENTS * 12)  # longer than the tiny model's 128 positions
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.score(QUERY, long_doc, use_tqdm=False)
    (out,) = llm.score(QUERY, long_doc, truncate_prompt_tokens=-1, use_tqdm=False)
    enc = tok(QUERY, long_doc, truncation=True, max_length=128, return_tensors="pt")
    with torch.inference_mode():
        ref = torch.sigmoid(hf(**enc).logits)[0, 0].item()
    assert len(out.prompt_token_ids) == 128 and out.outputs.score == pytest.approx(ref, abs=1e-5)
    # activation off: the raw logit
    from pagemill import PoolingParams

    (raw,) = llm.classify(QUERY, PoolingParams(activation=False), use_tqdm=False)
    with torch.inference_mode():
        logit = hf(**tok(QUERY, return_tensors="pt")).logits[0, 0].item()
    assert raw.outputs.probs[0] == pytest.approx(logit, abs=1e-5)
    with pytest.raises(ValueError, match="^task 'embed' is not supported"):
        llm.embed(QUERY, use_tqdm=False)


def test_matryoshka_dimensions(tmp_path, minilm_hf):
    """`dimensions` on a model that declares Matryoshka training: the first N values, renormalised."""
    model, tok = minilm_hf
    path = save_tiny_bert(str(tmp_path), tok, classifier=False, matryoshka_dimensions=[16, 32])
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path)
    from pagemill import PoolingParams

    (full,), (short,) = (llm.embed(QUERY, PoolingParams(dimensions=d), use_tqdm=False) for d in (None, 16))
    ref = hf_sentence_embedding(hf, tok, QUERY, normalize=False, pooling="CLS")
    assert len(full.outputs.embedding) == 64 and len(short.outputs.embedding) == 16
    assert torch.allclose(torch.tensor(short.outputs.embedding), F.normalize(ref[:16], dim=-1), atol=1e-5)
    with pytest.raises(ValueError, match=r"^dimensions must be one of \[16, 32\]"):
        llm.embed(QUERY, PoolingParams(dimensions=8), use_tqdm=False)
