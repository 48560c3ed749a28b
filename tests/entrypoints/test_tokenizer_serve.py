"""The tokenizer for clients: --tokenizer, /tokenizer_info, the Hub file protocol (unmodified huggingface_hub and
transformers load the server's tokenizer with HF_ENDPOINT), /invocations, and OpenAI error bodies on 404/405."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import httpx
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from pagemill.engine.arg_utils import EngineArgs
from pagemill.entrypoints.cli import build_parser
from pagemill.entrypoints.openai.serving_tokenizer_files import add_tokenizer_routes
from pagemill.entrypoints.openai.tokenizer_files import TokenizerFiles, git_blob_id, tokenizer_info
from tests.entrypoints.conftest import RemoteServer

KEY = "sk-tokenizer-test"
REPO = "acme/tiny-chat"  # a served name with a '/', as Hub ids have
ALIAS = "tiny"
CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
MAX_LEN_MARK = 777  # model_max_length of the --tokenizer directory: shows which tokenizer the server loaded


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_llama, tmp_path_factory) -> str:
    """A copy of the tiny model's tokenizer files with a model_max_length of its own (for --tokenizer)."""
    d = tmp_path_factory.mktemp("tokenizer")
    for name in os.listdir(tiny_llama):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(tiny_llama, name), d / name)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["model_max_length"] = MAX_LEN_MARK
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return str(d)


@pytest.fixture(scope="module")
def tok_server(tiny_llama, tokenizer_dir, tmp_path_factory):
    """`pagemill serve` on the tiny model with --tokenizer, two served names, an API key and a chat template."""
    srv = RemoteServer([tiny_llama, "--tokenizer", tokenizer_dir, "--served-model-name", REPO, ALIAS,
                        "--api-key", KEY, "--enable-tokenizer-info-endpoint", "--chat-template", CHAT_TEMPLATE,
                        "--kv-cache-memory", "64MiB", "--max-model-len", "256"],
                       tmp_path_factory.mktemp("tok_server") / "server.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(tok_server):
    """An httpx client with the API key."""
    with httpx.Client(base_url=tok_server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def _hf_client(server: RemoteServer, hf_home: str, code: str) -> dict:
    """Run `code` in a fresh interpreter with HF_ENDPOINT at the server (huggingface_hub reads it at import);
    the code prints one JSON line."""
    env = {**os.environ, "HF_ENDPOINT": server.url, "HF_HOME": hf_home, "HF_TOKEN": KEY,
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=180, cwd=hf_home)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- offline parts -----------------------------------------------------------------------------------------------

def test_tokenizer_files_export_with_git_blob_etags(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    files = TokenizerFiles(tok).files()
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(files)
    for name, f in files.items():  # the Hub's ETag of a git file is its blob id, as git computes it
        blob = subprocess.run(["git", "hash-object", "--stdin"], input=f.content, capture_output=True, check=True)
        assert f.etag == blob.stdout.decode().strip(), name
    assert json.loads(files["tokenizer_config.json"].content)["model_max_length"] == MAX_LEN_MARK
    with_template = TokenizerFiles(tok, CHAT_TEMPLATE)
    assert with_template.files()["chat_template.jinja"].content.decode() == CHAT_TEMPLATE
    assert TokenizerFiles(tok).commit_hash() == TokenizerFiles(tok).commit_hash() != with_template.commit_hash()
    assert git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # git's empty blob


def test_tokenizer_info_is_vllms_body(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    info = tokenizer_info(tok, CHAT_TEMPLATE)
    json.dumps(info)  # JSON-ready: AddedTokens became their text
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["chat_template"] == CHAT_TEMPLATE
    assert info["eos_token"] == tok.eos_token and "vocab_file" not in info and "merges_file" not in info
    assert tokenizer_info(tok, None).get("chat_template") == tok.init_kwargs.get("chat_template")


def test_routes_are_off_when_disabled(tokenizer_dir):
    from transformers import AutoTokenizer

    app = FastAPI()
    add_tokenizer_routes(app, AutoTokenizer.from_pretrained(tokenizer_dir), [REPO], None, enable_tokenizer_info=False,
                         serve_tokenizer_files=False)
    with TestClient(app) as c:
        assert c.get("/tokenizer_info").status_code == 404
        assert c.head(f"/{REPO}/resolve/main/tokenizer.json").status_code == 404
        assert c.get(f"/api/models/{REPO}").status_code == 404


def test_serve_flags_defaults():
    args = build_parser().parse_args(["serve"])
    assert args.serve_tokenizer_files is True and args.enable_tokenizer_info_endpoint is False  # vLLM: opt-in
    assert build_parser().parse_args(["serve", "--no-serve-tokenizer-files"]).serve_tokenizer_files is False


def test_tokenizer_argument_is_checked(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="^tokenizer .* does not exist"):
        EngineArgs(model=tiny_llama, tokenizer=str(tmp_path / "missing")).create_engine_config()
    with pytest.raises(ValueError, match="^tokenizer directory .* neither tokenizer.json"):
        EngineArgs(model=tiny_llama, tokenizer=str(tmp_path)).create_engine_config()


def test_tokenizer_argument_may_be_another_gguf(tiny_llama, smol_path):
    from transformers import AutoTokenizer

    from pagemill.loader.model_files import resolve_model
    from pagemill.loader.tokenizer import load_tokenizer

    resolved = resolve_model(tiny_llama, smol_path)
    assert resolved.tokenizer_path == smol_path and resolved.gguf_file is None
    tok = load_tokenizer(resolved.tokenizer_path, resolved.gguf_file, resolved.hf_config)
    text = "Hello <|im_start|>user\nwörld<|im_end|>"
    assert tok.encode(text) == AutoTokenizer.from_pretrained(tiny_llama).encode(text)  # tiny_llama has SmolLM2's


# -- the server ------------------------------------------------------------------------------------------------

def test_tokenizer_info_endpoint(http, tokenizer_dir):
    r = http.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["model_max_length"] == MAX_LEN_MARK  # the --tokenizer directory's, not the model's
    assert info["chat_template"] == CHAT_TEMPLATE and info["tokenizer_class"]


def test_hub_resolve_headers_and_errors(http):
    files = {f["path"]: f for f in http.get(f"/api/models/{REPO}/tree/main").json()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} == set(files)
    info = http.get(f"/api/models/{REPO}").json()
    commit = info["sha"]
    assert len(commit) == 40 and {s["rfilename"] for s in info["siblings"]} == set(files)
    assert http.get(f"/api/models/{ALIAS}/revision/main").json()["sha"] == commit
    for revision in ("main", commit):
        head = http.head(f"/{REPO}/resolve/{revision}/tokenizer.json")
        assert head.status_code == 200 and head.content == b""
        body = http.get(f"/{REPO}/resolve/{revision}/tokenizer.json").content
        assert head.headers["ETag"] == f'"{git_blob_id(body)}"' == f'"{files["tokenizer.json"]["oid"]}"'
        assert int(head.headers["Content-Length"]) == len(body) == files["tokenizer.json"]["size"]
        assert head.headers["X-Repo-Commit"] == commit
    assert http.get(f"/{REPO}/resolve/main/chat_template.jinja").text == CHAT_TEMPLATE
    cases = [("/acme/other/resolve/main/tokenizer.json", "RepoNotFound"),
             (f"/{REPO}/resolve/v2/tokenizer.json", "RevisionNotFound"),
             (f"/{REPO}/resolve/main/model.safetensors", "EntryNotFound"),
             ("/api/models/acme/other", "RepoNotFound"),
             (f"/api/models/{REPO}/tree/main/additional_chat_templates", "EntryNotFound")]
    for path, code in cases:
        r = http.get(path)
        assert r.status_code == 404 and r.headers["X-Error-Code"] == code, path
        assert r.json()["error"]["type"] == "NotFoundError" and r.json()["error"]["code"] == 404
    assert http.get(f"/{REPO}/resolve/main/model.safetensors").headers["X-Repo-Commit"] == commit
    assert httpx.get(f"{http.base_url}/{REPO}/resolve/main/tokenizer.json").status_code == 401  # no key


def test_transformers_loads_the_servers_tokenizer(tok_server, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    texts = ["Hello, world!", "def f(x):\n    return x  # ünïcødé", "<|im_start|>user\nHi<|im_end|>"]
    code = f"""
        import json
        from huggingface_hub import hf_hub_download
        from transformers import AutoTokenizer
        out = {{}}
        for name in ({REPO!r}, {ALIAS!r}):
            tok = AutoTokenizer.from_pretrained(name)
            out[name] = {{"ids": [tok.encode(t) for t in {texts!r}], "template": tok.chat_template,
                         "max_len": tok.model_max_length, "vocab": len(tok)}}
        out["file"] = open(hf_hub_download({REPO!r}, "tokenizer_config.json")).read()
        print(json.dumps(out))
        """
    got = _hf_client(tok_server, str(tmp_path), code)
    local = AutoTokenizer.from_pretrained(tokenizer_dir)
    for name in (REPO, ALIAS):
        assert got[name]["ids"] == [local.encode(t) for t in texts]
        assert got[name]["template"] == CHAT_TEMPLATE  # the server's --chat-template
        assert got[name]["max_len"] == MAX_LEN_MARK and got[name]["vocab"] == len(local)
    assert json.loads(got["file"])["model_max_length"] == MAX_LEN_MARK


def test_invocations_routes_by_body_shape(http):
    r = http.post("/invocations", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    r = http.post("/invocations", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    for body, param in [({"input": "Hi"}, "model"),  # embeddings on a generating model: its own 400
                        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
                        ({"text": "x"}, None), ([1, 2], None)]:
        r = http.post("/invocations", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = http.post("/invocations", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_openai_error_bodies_on_404_and_405(http):
    for method, path, status in [("GET", "/v1/no-such-endpoint", 404), ("POST", "/no/such/path", 404),
                                 ("GET", "/v1/completions", 405), ("GET", "/invocations", 405),
                                 ("DELETE", "/v1/chat/completions", 405), ("POST", "/tokenizer_info", 405)]:
        r = http.request(method, path)
        assert r.status_code == status, (method, path, r.text)
        err = r.json()["error"]
        assert err["code"] == status and err["type"] in ("NotFoundError", "MethodNotAllowedError")
        if status == 405:
            assert r.headers["Allow"]
