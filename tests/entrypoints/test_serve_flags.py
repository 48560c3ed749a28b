"""`pagemill serve` takes vLLM's flag spellings and flags: `--max_model_len` as well as `--max-model-len`,
`--enable-force-include-usage`, `--skip-tokenizer-init` (token ids in, token ids out); an unknown flag fails with
the closest valid name. Through a real server and the openai client / httpx."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from pagemill.entrypoints.cli import build_parser
from tests.entrypoints.conftest import MODEL, RemoteServer

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary


def test_underscore_spellings_parse_like_dashes():
    dashed = build_parser().parse_args(["serve", "--max-model-len", "512", "--max-num-seqs", "4",
                                        "--no-enable-prefix-caching", "--tool-call-parser", "pythonic"])
    under = build_parser().parse_args(["serve", "--max_model_len", "512", "--max_num_seqs=4",
                                       "--no-enable_prefix_caching", "--tool_call_parser", "pythonic"])
    assert vars(dashed) == vars(under)
    assert under.max_model_len == 512 and under.max_num_seqs == 4 and under.enable_prefix_caching is False
    flags = build_parser().parse_args(["serve", "--enable_force_include_usage", "--skip_tokenizer_init"])
    assert flags.enable_force_include_usage and flags.skip_tokenizer_init


@pytest.mark.parametrize("flag,suggestion", [("--max_modle_len", "--max-model-len"),
                                             ("--enable-force-usage", "--enable-force-include-usage"),
                                             ("--skip-tokeniser-init", "--skip-tokenizer-init")])
def test_unknown_flag_names_the_closest(flag, suggestion):
    r = subprocess.run([sys.executable, "-m", "pagemill.entrypoints.cli", "serve", flag, "1"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert f"unrecognized arguments: {flag}" in r.stderr and f"did you mean {suggestion}?" in r.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RemoteServer(["--kv_cache_memory", "128MiB", "--max_model_len", "512", "--disable-uvicorn-access-log",
                        "--skip-tokenizer-init", "--enable-force-include-usage", "--max_logprobs", "-1"],
                       tmp_path_factory.mktemp("flags") / "server.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_token_in_token_out(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0)
    choice = out.choices[0]
    assert choice.text == ""
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == PROMPT_IDS and len(extra["token_ids"]) == 6
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 6
    again = client.completions.create(model=MODEL, prompt=[PROMPT_IDS, PROMPT_IDS[:3]], max_tokens=3,
                                      temperature=0, logprobs=2)
    assert again.choices[0].model_extra["token_ids"] == extra["token_ids"][:3]
    assert all(t.startswith("token_id:") for t in again.choices[0].logprobs.tokens)


def test_text_needs_a_tokenizer(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 400 and "skip_tokenizer_init" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 2, "stop": ["x"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "skip_tokenizer_init" in r.json()["error"]["message"]
        r = http.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = http.post("/detokenize", json={"model": MODEL, "tokens": [1, 2]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        assert http.get("/health").status_code == 200


def test_force_include_usage_without_stream_options(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 4,
                                                          "ignore_eos": True, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c.get("usage") is None for c in chunks[:-1])
    streamed = [t for c in chunks[:-1] for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert len(streamed) == 4


def test_request_details(server):
    """logprobs=-1 is the whole vocabulary (--max-logprobs -1 allows it); errors name every bad value; an
    over-long prompt says "maximum context length" as OpenAI and vLLM do."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 1, "logprobs": -1})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 49152
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 1,
                                               "logit_bias": {"5": 1, "49152": 2, "100000": 3}})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "logit_bias" and "49152, 100000" in err["message"]
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [7] * 600, "max_tokens": 1})
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT_IDS, "logprobs": -2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
