"""A real `pagemill serve` of pooling models on 127.0.0.1: all-MiniLM-L6-v2 (/v1/embeddings through the real
`openai` client, float and base64; /pooling; cosine /score and /rerank) and a tiny random BERT cross-encoder
(/score, /rerank), against HF; bad input is a 400 naming the field; generate and pooling endpoints refuse the
other kind of model."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
import torch

from pagemill.benchmarks.embed_texts import mixed_length_texts
from tests.entrypoints.conftest import API_KEY, RemoteServer
from tests.pooling.conftest import hf_sentence_embedding, minilm_dir, save_tiny_bert

EMBED_MODEL, CROSS_MODEL = "minilm", "tiny-cross-encoder"
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.", "Bananas are rich in potassium.",
             "Berlin is the capital of Germany.", "France's capital, Paris, lies on the Seine.",
             "Cats sleep for most of the day."]


def start(tmp_path_factory, name: str, model_path: str) -> RemoteServer:
    srv = RemoteServer([model_path, "--served-model-name", name, "--api-key", API_KEY,
                        "--disable-uvicorn-access-log"], tmp_path_factory.mktemp(name) / "server.log")
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    srv = start(tmp_path_factory, EMBED_MODEL, minilm_dir())
    yield srv
    assert srv.stop() in (0, -15), srv.log_tail()


@pytest.fixture(scope="module")
def hf_minilm():
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_dir(), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(minilm_dir())


@pytest.fixture(scope="module")
def cross(tmp_path_factory, hf_minilm):
    """(server, HF model, tokenizer) of a tiny random BertForSequenceClassification."""
    from transformers import AutoModelForSequenceClassification

    tok = hf_minilm[1]
    path = save_tiny_bert(str(tmp_path_factory.mktemp("cross-model")), tok, classifier=True)
    srv = start(tmp_path_factory, CROSS_MODEL, path)
    yield srv, AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval(), tok
    assert srv.stop() in (0, -15), srv.log_tail()


def client_for(srv: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(srv: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def test_models_say_what_the_model_does(embed_server):
    (card,) = client_for(embed_server).models.list().data
    assert card.id == EMBED_MODEL and card.model_extra["runner"] == "pooling"
    assert set(card.model_extra["supported_tasks"]) == {"embed", "encode", "score"}
    assert card.model_extra["max_model_len"] == 256


def test_embeddings_float_and_base64_match_hf(embed_server, hf_minilm):
    model, tok = hf_minilm
    texts = mixed_length_texts(16, seed=3, max_words=100)
    client = client_for(embed_server)
    as_float = client.embeddings.create(model=EMBED_MODEL, input=texts, encoding_format="float")
    as_b64 = client.embeddings.create(model=EMBED_MODEL, input=texts)  # the client asks for base64 and decodes it
    raw = post(embed_server, "/v1/embeddings", {"model": EMBED_MODEL, "input": texts[:2],
                                                "encoding_format": "base64"}).json()
    assert isinstance(raw["data"][0]["embedding"], str) and raw["data"][0]["object"] == "embedding"
    assert as_float.object == "list" and [d.index for d in as_float.data] == list(range(len(texts)))
    ours = torch.tensor([d.embedding for d in as_float.data])
    # (the two requests may be split into engine steps differently: equal up to float rounding)
    assert torch.allclose(ours, torch.tensor([d.embedding for d in as_b64.data]), atol=1e-6)
    refs = torch.stack([hf_sentence_embedding(model, tok, t) for t in texts])
    assert torch.nn.functional.cosine_similarity(ours, refs, dim=-1).min() >= 0.99999
    num_tokens = sum(len(tok.encode(t)) for t in texts)
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == num_tokens


def test_base64_is_little_endian_float32_bytes():
    import base64

    import numpy as np

    from pagemill.entrypoints.openai.serving_pooling import encode_vector
    from pagemill.outputs import PoolingOutput

    out = PoolingOutput(torch.tensor([0.1, -2.5, 3e-8], dtype=torch.float32))
    decoded = np.frombuffer(base64.b64decode(encode_vector(out, "base64")), dtype="<f4")
    assert decoded.tolist() == out.data.tolist() == encode_vector(out, "float")


def test_embedding_input_forms(embed_server, hf_minilm):
    tok = hf_minilm[1]
    client = client_for(embed_server)
    ids = [tok.encode(t) for t in DOCUMENTS[:2]]
    by_text = client.embeddings.create(model=EMBED_MODEL, input=DOCUMENTS[0], encoding_format="float")
    by_ids = client.embeddings.create(model=EMBED_MODEL, input=ids, encoding_format="float")
    by_one_ids = client.embeddings.create(model=EMBED_MODEL, input=ids[0], encoding_format="float")
    first = [torch.tensor(r.data[0].embedding) for r in (by_text, by_ids, by_one_ids)]
    assert all(torch.allclose(first[0], x, atol=1e-6) for x in first[1:])
    assert len(by_ids.data) == 2 and by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    pooled = post(embed_server, "/pooling", {"input": DOCUMENTS[0]}).json()
    assert pooled["object"] == "list" and pooled["data"][0]["object"] == "pooling"
    assert torch.allclose(torch.tensor(pooled["data"][0]["data"]), first[0], atol=1e-6)
    raw = client.embeddings.create(model=EMBED_MODEL, input=DOCUMENTS[0], encoding_format="float",
                                   extra_body={"normalize": False})
    assert torch.tensor(raw.data[0].embedding).norm() > 1.5


def test_concurrent_requests_share_steps(embed_server, hf_minilm):
    """Many clients at once: every answer is right (their requests are batched in the engine's steps)."""
    model, tok = hf_minilm
    texts = mixed_length_texts(16, seed=4, max_words=40)
    client = client_for(embed_server)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda t: client.embeddings.create(model=EMBED_MODEL, input=t, encoding_format="float"),
                             texts))
    ours = torch.tensor([o.data[0].embedding for o in outs])
    refs = torch.stack([hf_sentence_embedding(model, tok, t) for t in texts])
    assert torch.nn.functional.cosine_similarity(ours, refs, dim=-1).min() >= 0.99999
    m = embed_server.wait_idle()
    assert m["pagemill:prompt_tokens_total"] >= sum(len(tok.encode(t)) for t in texts)


def test_cosine_score_and_rerank_match_hf(embed_server, hf_minilm):
    model, tok = hf_minilm
    q = hf_sentence_embedding(model, tok, QUERY)
    ref = torch.stack([q @ hf_sentence_embedding(model, tok, d) for d in DOCUMENTS])
    score = post(embed_server, "/score", {"model": EMBED_MODEL, "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert score["object"] == "list" and [d["object"] for d in score["data"]] == ["score"] * len(DOCUMENTS)
    got = torch.tensor([d["score"] for d in score["data"]])
    assert torch.allclose(got, ref, atol=1e-5)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        rr = post(embed_server, path, {"model": EMBED_MODEL, "query": QUERY, "documents": DOCUMENTS,
                                       "top_n": 3}).json()
        assert [r["index"] for r in rr["results"]] == torch.argsort(ref, descending=True)[:3].tolist()
        assert rr["results"][0]["document"]["text"] == DOCUMENTS[rr["results"][0]["index"]]
        assert rr["usage"]["total_tokens"] > 0
    bare = post(embed_server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "return_documents": False}).json()
    assert len(bare["results"]) == len(DOCUMENTS) and bare["results"][0].get("document") is None
    scores = [r["relevance_score"] for r in bare["results"]]
    assert scores == sorted(scores, reverse=True)


def test_cross_encoder_score_and_rerank_match_hf(cross):
    srv, hf, tok = cross
    enc = tok([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        logits = hf(**enc).logits[:, 0]
    score = post(srv, "/score", {"model": CROSS_MODEL, "text_1": QUERY, "text_2": DOCUMENTS}).json()
    got = torch.tensor([d["score"] for d in score["data"]])
    assert torch.allclose(got, torch.sigmoid(logits), atol=1e-5)
    zipped = post(srv, "/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]}).json()
    assert [d["score"] for d in zipped["data"]] == pytest.approx(got[:2].tolist(), abs=1e-6)
    rr = post(srv, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()
    assert [r["index"] for r in rr["results"]] == torch.argsort(logits, descending=True).tolist()
    assert [r["relevance_score"] for r in rr["results"]] == pytest.approx(
        torch.sigmoid(logits).sort(descending=True).values.tolist(), abs=1e-5)
    (card,) = client_for(srv).models.list().data
    assert card.model_extra["supported_tasks"] == ["classify", "score", "encode"]
    err = post(srv, "/v1/embeddings", {"input": "hi"})
    assert err.status_code == 400 and err.json()["error"]["param"] == "model"
    assert "'embed'" in err.json()["error"]["message"]


LONG = "word " * 400
# (case id, path, JSON body, expected `param`, text the message must contain)
BAD = [
    ("dimensions_not_matryoshka", "/v1/embeddings", {"input": "hi", "dimensions": 8}, "dimensions", "Matryoshka"),
    ("dimensions_zero", "/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions", "positive"),
    ("over_long", "/v1/embeddings", {"input": LONG}, "input", "truncate_prompt_tokens"),
    ("over_long_ids", "/v1/embeddings", {"input": [[101] * 300]}, "input", "max_model_len"),
    ("truncate_too_long", "/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 999}, "truncate_prompt_tokens",
     "max_model_len"),
    ("truncate_negative", "/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens",
     ""),
    ("empty_input", "/v1/embeddings", {"input": []}, "input", "empty"),
    ("empty_string", "/v1/embeddings", {"input": ["a", ""]}, "input", "empty"),
    ("bad_encoding_format", "/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ("token_out_of_vocab", "/v1/embeddings", {"input": [[101, 10**6]]}, "input", "prompt_token_ids"),
    ("missing_input", "/v1/embeddings", {"model": EMBED_MODEL}, "input", "required"),
    ("priority_without_policy", "/v1/embeddings", {"input": "hi", "priority": 3}, "priority", "priority"),
    ("score_mismatch", "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "text_1 has 2"),
    ("score_empty", "/score", {"text_1": "a", "text_2": []}, "text_2", "empty"),
    ("rerank_no_documents", "/rerank", {"query": "a", "documents": []}, "documents", "empty"),
    ("rerank_negative_top_n", "/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", ""),
    ("completions_on_pooling", "/v1/completions", {"prompt": "hi"}, "model", "pooling model"),
    ("chat_on_pooling", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model",
     "pooling model"),
    ("unknown_model", "/v1/embeddings", {"model": "gpt-4", "input": "hi"}, "model", "does not exist"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_a_400_naming_the_field(embed_server, case):
    _, path, body, param, text = case
    r = post(embed_server, path, body)
    status = 404 if param == "model" and "does not exist" in text else 400
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"] and err["code"] == status


def test_unknown_field_is_ignored_with_a_header(embed_server):
    r = post(embed_server, "/v1/embeddings", {"input": "hi", "encoding": "float"})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "encoding"
    assert len(r.json()["data"][0]["embedding"]) == 384


def test_server_is_fine_after_bad_input(embed_server):
    ok = client_for(embed_server).embeddings.create(model=EMBED_MODEL, input=LONG, encoding_format="float",
                                                    extra_body={"truncate_prompt_tokens": -1})
    assert len(ok.data[0].embedding) == 384 and ok.usage.prompt_tokens == 256
    with pytest.raises(openai.BadRequestError) as e:
        client_for(embed_server).embeddings.create(model=EMBED_MODEL, input="hi", dimensions=16)
    assert e.value.body["param"] == "dimensions"
    m = embed_server.wait_idle()
    assert m["pagemill:kv_cache_total_blocks"] == 0  # an encoder has no KV cache at all


def test_generate_server_refuses_pooling_endpoints(http):
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/pooling", {"input": "hi"}),
                       ("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]})):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", (path, r.text)
        assert "needs a pooling model" in r.json()["error"]["message"]
    (card,) = http.get("/v1/models").json()["data"]
    assert card["runner"] == "generate" and card["supported_tasks"] == ["generate"]
