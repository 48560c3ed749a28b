"""vLLM's extras of the pooling endpoints through a real server: base64 / bytes / bytes_only with embed_dtype and
endianness, chat-style `messages` input, /classify, `dimensions` and over-long inputs as 400s naming the field."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.entrypoints.conftest import RemoteServer
from tests.pooling.conftest import minilm_dir, save_tiny_bert

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
TEXTS = ["Paris is the capital of France.", "Bananas are yellow."]


def start(tmp_path_factory, name: str, args: list[str]) -> RemoteServer:
    srv = RemoteServer([*args, "--served-model-name", name, "--disable-uvicorn-access-log"],
                       tmp_path_factory.mktemp(name) / "server.log")
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="module")
def embed(tmp_path_factory):
    srv = start(tmp_path_factory, "minilm", [minilm_dir(), "--chat-template", TEMPLATE])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(embed):
    with httpx.Client(base_url=embed.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def floats(http):
    r = http.post("/v1/embeddings", json={"model": "minilm", "input": TEXTS})
    assert r.status_code == 200
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def test_openai_client_base64_default(embed, floats):
    """The openai SDK asks for base64 by default and decodes little-endian float32."""
    with openai.OpenAI(base_url=embed.url + "/v1", api_key="x", max_retries=0) as client:
        out = client.embeddings.create(model="minilm", input=TEXTS)
    np.testing.assert_allclose(np.array([d.embedding for d in out.data]), floats, atol=1e-6)


@pytest.mark.parametrize("dtype,np_dtype", [("float32", "f4"), ("float16", "f2")])
@pytest.mark.parametrize("endianness", ["little", "big", "native"])
def test_base64_dtypes_and_endianness(http, floats, dtype, np_dtype, endianness):
    r = http.post("/v1/embeddings", json={"model": "minilm", "input": TEXTS, "encoding_format": "base64",
                                          "embed_dtype": dtype, "endianness": endianness})
    assert r.status_code == 200
    order = {"little": "<", "big": ">", "native": "="}[endianness]
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), order + np_dtype) for d in r.json()["data"]])
    np.testing.assert_allclose(got.astype(np.float32), floats, atol=1e-6 if dtype == "float32" else 1e-3)


@pytest.mark.parametrize("endianness", ["little", "big"])
def test_bytes_with_metadata_and_bytes_only(http, floats, endianness):
    r = http.post("/v1/embeddings", json={"model": "minilm", "input": TEXTS, "encoding_format": "bytes",
                                          "embed_dtype": "bfloat16", "endianness": endianness})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    meta = json.loads(r.headers["metadata"])
    assert meta["model"] == "minilm" and meta["usage"]["prompt_tokens"] > 0 and len(meta["data"]) == 2
    for item, want in zip(meta["data"], floats):
        assert item["embed_dtype"] == "bfloat16" and item["shape"] == [384]
        raw = np.frombuffer(r.content[item["start"]:item["end"]], np.uint8).reshape(-1, 2)
        raw = raw[:, ::-1] if endianness == "big" else raw
        got = torch.from_numpy(raw.copy().reshape(-1)).view(torch.bfloat16).float()
        torch.testing.assert_close(got, torch.from_numpy(want), atol=4e-3, rtol=0)
    only = http.post("/v1/embeddings", json={"model": "minilm", "input": TEXTS, "encoding_format": "bytes_only",
                                             "embed_dtype": "bfloat16", "endianness": endianness})
    assert only.status_code == 200 and "metadata" not in only.headers and len(only.content) == len(r.content)
    pooled = http.post("/pooling", json={"model": "minilm", "input": TEXTS, "encoding_format": "bytes_only"})
    np.testing.assert_allclose(np.frombuffer(pooled.content, np.float32).reshape(2, -1), floats, atol=1e-6)


def test_messages_input(http, floats):
    """Chat-style input: the messages rendered with the chat template, then embedded."""
    r = http.post("/v1/embeddings", json={"model": "minilm", "messages": [{"role": "user", "content": TEXTS[0]}],
                                          "add_special_tokens": True})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], floats[0], atol=1e-6)
    bare = http.post("/v1/embeddings", json={"model": "minilm", "messages": [{"role": "user", "content": TEXTS[0]}]})
    assert bare.status_code == 200 and bare.json()["usage"]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"] - 2


@pytest.mark.parametrize("body,param,words", [
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "messages", "exactly one"),
    ({}, "input", "required"),
    ({"input": "x", "encoding_format": "bytes2"}, "encoding_format", ""),
    ({"input": "x", "embed_dtype": "int8"}, "embed_dtype", ""),
    ({"input": "x", "endianness": "middle"}, "endianness", ""),
    ({"input": "x", "dimensions": 32}, "dimensions", "Matryoshka"),
    ({"input": "word " * 600}, "input", "maximum context length"),
    ({"input": "x", "truncate_prompt_tokens": 100000}, "truncate_prompt_tokens", "max_model_len"),
])
def test_bad_requests_name_the_field(http, body, param, words):
    r = http.post("/v1/embeddings", json={"model": "minilm", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err.get("param") or "") + err["message"] and words in err["message"]


def test_truncation_keeps_the_input_within_the_context(http):
    r = http.post("/v1/embeddings", json={"model": "minilm", "input": "word " * 600, "truncate_prompt_tokens": 16})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16


def test_classify_on_an_embedding_model_is_a_400(http):
    r = http.post("/classify", json={"model": "minilm", "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_classify(tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    path = save_tiny_bert(str(tmp_path_factory.mktemp("cls-model")), tok, classifier=True)
    srv = start(tmp_path_factory, "tiny-cls", [path])
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            r = c.post("/classify", json={"model": "tiny-cls", "input": TEXTS})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
            for i, d in enumerate(body["data"]):
                assert d["index"] == i and d["num_classes"] == 1 and d["label"] == "LABEL_0"
                assert 0.0 <= d["probs"][0] <= 1.0
            r = c.post("/classify", json={"model": "tiny-cls", "input": "x", "dimensions": 4})
            assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    finally:
        srv.stop()
