"""all-MiniLM-L6-v2 (real weights) through the pooling runner: embeddings equal HF AutoModel + the model's mean
pooling + normalisation, batched and alone; its sentence-transformers settings; bad input."""

from __future__ import annotations

import pytest
import torch

from pagemill import EmbeddingRequestOutput, PoolingParams
from tests.pooling.conftest import cosines, hf_sentence_embedding


@pytest.fixture(scope="module")
def hf_refs(minilm_hf, texts) -> list[torch.Tensor]:
    """HF embeddings of the 100 texts, each computed alone (no padding)."""
    model, tok = minilm_hf
    return [hf_sentence_embedding(model, tok, t) for t in texts]


def test_settings_from_sentence_transformers_files(minilm_llm):
    mc = minilm_llm.llm_engine.config.model_config
    pc = mc.pooler_config
    assert mc.runner_type == "pooling"
    assert (pc.pooling_type, pc.normalize, pc.head, pc.encoder_only) == ("MEAN", True, "embed", True)
    assert mc.max_model_len == 256  # sentence_bert_config.json's max_seq_length, under the 512 positions
    assert not minilm_llm.llm_engine.config.cache_config.enable_prefix_caching
    assert minilm_llm.llm_engine.engine_core.kv_cache_config.has_kv_cache is False


def test_embeddings_batched_match_hf(minilm_llm, texts, hf_refs):
    outs = minilm_llm.embed(texts, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outs)
    assert [len(o.outputs.embedding) for o in outs] == [384] * len(texts)
    cos = cosines([o.outputs.embedding for o in outs], hf_refs)
    assert cos.min() >= 0.99999, cos.min()
    norms = torch.tensor([o.outputs.embedding for o in outs]).norm(dim=-1)
    assert torch.allclose(norms, torch.ones(len(texts)), atol=1e-5)
    stats = minilm_llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.num_blocks_total == 0


def test_embeddings_alone_match_hf_and_batched(minilm_llm, texts, hf_refs):
    alone = [minilm_llm.embed(t, use_tqdm=False)[0].outputs.embedding for t in texts]
    assert cosines(alone, hf_refs).min() >= 0.99999
    batched = [o.outputs.embedding for o in minilm_llm.embed(texts[::-1], use_tqdm=False)][::-1]
    assert torch.allclose(torch.tensor(alone), torch.tensor(batched), atol=2e-6)


def test_token_ids_and_dict_prompts_equal_text(minilm_llm, minilm_hf, texts):
    tok = minilm_hf[1]
    ids = tok.encode(texts[3])
    a, b, c = minilm_llm.embed([texts[3], ids, {"prompt_token_ids": ids}], use_tqdm=False)
    assert a.prompt_token_ids == b.prompt_token_ids == ids
    vectors = torch.tensor([o.outputs.embedding for o in (a, b, c)])
    assert torch.allclose(vectors[0], vectors[1], atol=1e-6) and torch.allclose(vectors[0], vectors[2], atol=1e-6)


def test_normalize_off_gives_the_mean(minilm_llm, minilm_hf, texts):
    model, tok = minilm_hf
    out = minilm_llm.embed(texts[:4], PoolingParams(normalize=False), use_tqdm=False)
    refs = [hf_sentence_embedding(model, tok, t, normalize=False) for t in texts[:4]]
    assert torch.allclose(torch.tensor([o.outputs.embedding for o in out]), torch.stack(refs), atol=1e-4)


def test_encode_returns_tensor(minilm_llm, texts):
    (out,) = minilm_llm.encode(texts[0], use_tqdm=False)
    emb = minilm_llm.embed(texts[0], use_tqdm=False)[0].outputs.embedding
    assert out.outputs.data.dtype == torch.float32 and out.outputs.data.tolist() == emb


def test_too_long_input_is_an_error_unless_truncated(minilm_llm, minilm_hf):
    model, tok = minilm_hf
    long_text = "word " * 400
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        minilm_llm.embed(long_text, use_tqdm=False)
    (out,) = minilm_llm.embed(long_text, truncate_prompt_tokens=-1, use_tqdm=False)
    assert len(out.prompt_token_ids) == 256 and out.prompt_token_ids[-1] == tok.sep_token_id
    ref = hf_sentence_embedding(model, tok, long_text, max_length=256)
    assert cosines([out.outputs.embedding], [ref]).item() >= 0.99999
    (short,) = minilm_llm.embed(long_text, truncate_prompt_tokens=10, use_tqdm=False)
    assert len(short.prompt_token_ids) == 10
    (ids_out,) = minilm_llm.embed(list(range(1000, 1300)), truncate_prompt_tokens=20, use_tqdm=False)
    assert ids_out.prompt_token_ids == list(range(1280, 1300))  # token ids keep their last k, as vLLM
    with pytest.raises(ValueError, match="^truncate_prompt_tokens"):
        minilm_llm.embed("hi", truncate_prompt_tokens=300, use_tqdm=False)
    with pytest.raises(ValueError, match="^truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)


def test_bad_dimensions_and_tasks(minilm_llm):
    with pytest.raises(ValueError, match="^dimensions: this model does not support Matryoshka"):
        minilm_llm.embed("hello", PoolingParams(dimensions=32), use_tqdm=False)
    with pytest.raises(ValueError, match="^dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="^task 'classify' is not supported"):
        minilm_llm.classify("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="^prompt_token_ids must be in"):
        minilm_llm.embed([[5, 40000]], use_tqdm=False)
    with pytest.raises(ValueError, match="^sampling_params: this is a pooling model"):
        minilm_llm.generate("hello", use_tqdm=False)
    # nothing broke: the engine is idle and still embeds
    assert not minilm_llm.llm_engine.has_unfinished_requests()
    assert len(minilm_llm.embed("hello", use_tqdm=False)[0].outputs.embedding) == 384


def test_runner_arguments(minilm_path):
    from pagemill.engine.arg_utils import EngineArgs

    assert EngineArgs(model=minilm_path, task="embed").create_engine_config().model_config.runner_type == "pooling"
    with pytest.raises(ValueError, match="runner='generate'"):
        EngineArgs(model=minilm_path, runner="generate").create_engine_config()
    with pytest.raises(ValueError, match="pooler_config.pooling_type"):
        EngineArgs(model=minilm_path, pooler_config={"pooling_type": "MAX"}).create_engine_config()
    with pytest.raises(ValueError, match="unknown keys"):
        EngineArgs(model=minilm_path, pooler_config='{"pool": "CLS"}').create_engine_config()
    cls = EngineArgs(model=minilm_path, pooler_config='{"pooling_type": "cls", "normalize": false}')
    pc = cls.create_engine_config().model_config.pooler_config
    assert (pc.pooling_type, pc.normalize) == ("CLS", False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineArgs(model=minilm_path, max_num_batched_tokens=64, max_model_len=128).create_engine_config()


def test_cls_pooling_override_matches_hf(minilm_path, minilm_hf, texts):
    from pagemill import LLM

    model, tok = minilm_hf
    llm = LLM(minilm_path, pooler_config={"pooling_type": "CLS"})
    outs = llm.embed(texts[:8], use_tqdm=False)
    refs = [hf_sentence_embedding(model, tok, t, pooling="CLS") for t in texts[:8]]
    assert cosines([o.outputs.embedding for o in outs], refs).min() >= 0.99999
