"""Multi-LoRA through a real `pagemill serve` and the `openai` client: --lora-modules, the `model` field, /v1/models,
runtime load/unload (VLLM_ALLOW_RUNTIME_LORA_UPDATING), and the 400/404 answers; references from HF + PEFT."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from pagemill.entrypoints.cli import build_parser
from pagemill.entrypoints.openai.cli_args import engine_args_from_namespace
from pagemill.entrypoints.openai.lora_modules import LoRAModulePath, runtime_lora_updating_allowed
from tests.conftest import hf_greedy
from tests.entrypoints.conftest import MODEL, RemoteServer, free_port

PROMPTS = ["The capital of France is", "Once upon a time"]
MAX_TOKENS = 12
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_smol_adapter(hf_model: torch.nn.Module, out_dir: str, seed: int, rank: int, targets: list[str],
                      prompts: list[list[int]]) -> list[list[int]]:
    """Save a random PEFT adapter of SmolLM2 (B != 0, so it changes the output); its HF + PEFT greedy tokens."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                               init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.15)
    model.save_pretrained(out_dir)
    model.eval()
    return [hf_greedy(model, ids, MAX_TOKENS) for ids in prompts]


@pytest.fixture(scope="module")
def adapters(smol_hf, tmp_path_factory) -> dict[str, tuple[str, list[str]]]:
    """name -> (directory, expected greedy texts of PROMPTS): the base model, a0 (rank 8, all projections), a1
    (rank 16, q/v/o); plus `big` (rank 32) and `broken` (truncated weights) with no texts."""
    model, tok = smol_hf
    root = tmp_path_factory.mktemp("smol_lora")
    ids = [tok.encode(p) for p in PROMPTS]

    def texts(refs: list[list[int]]) -> list[str]:
        return [tok.decode(r, skip_special_tokens=True) for r in refs]

    out = {MODEL: ("", texts([hf_greedy(model, p, MAX_TOKENS) for p in ids]))}
    for name, seed, rank, targets in [("a0", 1, 8, ALL_TARGETS), ("a1", 2, 16, ["q_proj", "v_proj", "o_proj"])]:
        path = str(root / name)
        out[name] = (path, texts(make_smol_adapter(model, path, seed, rank, targets, ids)))
    out["big"] = (str(root / "big"), [])
    make_smol_adapter(model, out["big"][0], 3, 32, ["q_proj"], [])
    broken = shutil.copytree(out["a0"][0], root / "broken")
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    out["broken"] = (str(broken), [])
    assert len({tuple(t) for n, (_, t) in out.items() if t}) == 3  # each adapter changes the output
    return out


@pytest.fixture(scope="module")
def lora_server(adapters, tmp_path_factory):
    """A server with a0 (name=path) and a1 (JSON) from start-up, runtime updating allowed."""
    a1 = json.dumps({"name": "a1", "path": adapters["a1"][0], "base_model_name": MODEL})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        srv = RemoteServer(["--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--disable-uvicorn-access-log",
                            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4",
                            "--lora-modules", f"a0={adapters['a0'][0]}", a1],
                           tmp_path_factory.mktemp("lora_server") / "server.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def lclient(lora_server):
    with openai.OpenAI(base_url=lora_server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def lhttp(lora_server):
    with httpx.Client(base_url=lora_server.url, timeout=120) as c:
        yield c


def complete(client: openai.OpenAI, model: str, prompt: str | list[int], max_tokens: int = MAX_TOKENS,
             **extra) -> str:
    """Greedy completion text of exactly max_tokens tokens."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True}, **extra)
    assert r.model == model
    return r.choices[0].text


def model_ids(http: httpx.Client) -> list[str]:
    return [m["id"] for m in http.get("/v1/models").json()["data"]]


# ---- flags ----
def test_lora_flags_parse_like_vllm():
    args = build_parser().parse_args([
        "serve", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5",
        "--lora-modules", "a=/ad/a", '{"name": "b", "path": "/ad/b", "base_model_name": "m"}',
        "--lora-modules", '[{"name": "c", "path": "/ad/c"}]'])
    e = engine_args_from_namespace(args)
    assert (e.enable_lora, e.max_loras, e.max_lora_rank, e.max_cpu_loras) == (True, 3, 32, 5)
    assert args.lora_modules == [LoRAModulePath("a", "/ad/a"), LoRAModulePath("b", "/ad/b", "m"),
                                 LoRAModulePath("c", "/ad/c")]
    assert build_parser().parse_args(["serve"]).lora_modules is None
    for bad in ["just-a-path", '{"name": "x"}', '{"name": "x", "path": "/p", "rank": 8}', "{not json"]:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", bad])


def test_runtime_updating_switch():
    assert not runtime_lora_updating_allowed({})
    assert not runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "False"})
    assert runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime_lora_updating_allowed({"PAGEMILL_ALLOW_RUNTIME_LORA_UPDATING": "1"})


def test_lora_modules_without_enable_lora_is_a_startup_error():
    """Refused before the model loads (vLLM fails too, later, when the engine refuses the adapter)."""
    r = subprocess.run([sys.executable, "-m", "pagemill.entrypoints.cli", "serve", "--lora-modules", "a=/ad/a"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--lora-modules needs --enable-lora" in r.stderr


# ---- serving ----
def test_models_lists_the_adapters(lhttp, adapters):
    data = lhttp.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL, "a0", "a1"]
    for card in data[1:]:
        assert card["root"] == adapters[card["id"]][0] and card["parent"] == MODEL and card["object"] == "model"


def test_each_model_name_gets_its_adapter(lclient, adapters):
    """Greedy text through the server equals HF + PEFT for each adapter; the base model is unchanged."""
    for name in [MODEL, "a0", "a1"]:
        assert [complete(lclient, name, p) for p in PROMPTS] == adapters[name][1], name


def test_chat_uses_the_adapter(lclient, lhttp):
    """Chat with an adapter gives the completion of the rendered conversation with that adapter."""
    messages = [{"role": "user", "content": "Name a fruit."}]
    ids = lhttp.post("/tokenize", json={"messages": messages}).json()["tokens"]
    texts = {}
    for name in [MODEL, "a1"]:
        r = lclient.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert r.model == name
        texts[name] = r.choices[0].message.content
        assert texts[name] == complete(lclient, name, ids, max_tokens=8)
    assert texts[MODEL] != texts["a1"]


def test_concurrent_requests_mixing_adapters_and_base(lclient, adapters):
    """Base and both adapters at once (streamed and not): each request gets its own model's output."""
    cases = [(name, i, stream) for name in [MODEL, "a0", "a1"] for i in range(len(PROMPTS)) for stream in (0, 1)]

    def run(case: tuple[str, int, int]) -> str:
        name, i, stream = case
        if not stream:
            return complete(lclient, name, PROMPTS[i])
        chunks = lclient.completions.create(model=name, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(run, cases))
    assert got == [adapters[name][1][i] for name, i, _ in cases]


def test_unknown_model_is_404(lclient):
    with pytest.raises(openai.NotFoundError) as e:
        lclient.completions.create(model="a2", prompt="hi", max_tokens=2)
    assert "a2" in e.value.message and "a0, a1" in e.value.message
    assert e.value.body["param"] == "model"


# ---- runtime load / unload ----
def test_runtime_load_and_unload(lclient, lhttp, adapters):
    r = lhttp.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["a1"][0]})
    assert r.status_code == 200 and "b" in r.text
    assert model_ids(lhttp) == [MODEL, "a0", "a1", "b"]
    assert complete(lclient, "b", PROMPTS[0]) == adapters["a1"][1][0]  # usable at once
    r = lhttp.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 200 and "b" in r.text
    assert model_ids(lhttp) == [MODEL, "a0", "a1"]
    with pytest.raises(openai.NotFoundError):
        complete(lclient, "b", PROMPTS[0])
    # a name can be served again after its unload (under a fresh id); unloading by id
    assert lhttp.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["a0"][0]}).is_success
    assert complete(lclient, "b", PROMPTS[0]) == adapters["a0"][1][0]
    lora_id = 4  # a0 = 1, a1 = 2, the first b = 3
    assert lhttp.post("/v1/unload_lora_adapter", json={"lora_int_id": lora_id}).is_success
    assert model_ids(lhttp) == [MODEL, "a0", "a1"]


def test_load_inplace_replaces_an_adapter(lclient, lhttp, adapters):
    assert lhttp.post("/v1/load_lora_adapter", json={"lora_name": "swap", "lora_path": adapters["a0"][0]}).is_success
    assert complete(lclient, "swap", PROMPTS[1]) == adapters["a0"][1][1]
    r = lhttp.post("/v1/load_lora_adapter", json={"lora_name": "swap", "lora_path": adapters["a1"][0],
                                                  "load_inplace": True})
    assert r.is_success
    assert complete(lclient, "swap", PROMPTS[1]) == adapters["a1"][1][1]
    assert [m["root"] for m in lhttp.get("/v1/models").json()["data"] if m["id"] == "swap"] == [adapters["a1"][0]]
    assert lhttp.post("/v1/unload_lora_adapter", json={"lora_name": "swap"}).is_success


@pytest.mark.parametrize("body,status,param,words", [
    ({"lora_name": "a0", "lora_path": "ADAPTER:a1"}, 400, "lora_name", "already loaded"),
    ({"lora_name": MODEL, "lora_path": "ADAPTER:a1"}, 400, "lora_name", "served base model"),
    ({"lora_name": "x", "lora_path": "/no/such/adapter"}, 400, "lora_path", "is not a directory"),
    ({"lora_name": "x", "lora_path": "ADAPTER:big"}, 400, "lora_path", "larger than max_lora_rank (16)"),
    ({"lora_name": "x", "lora_path": "ADAPTER:broken"}, 400, "lora_path", "cannot be read"),
    ({"lora_name": "x", "lora_path": ""}, 400, "lora_path", "must not be empty"),
    ({"lora_name": "x"}, 400, "lora_path", "field required"),
])
def test_bad_loads_are_400_naming_the_field(lhttp, adapters, body, status, param, words):
    body = {k: adapters[v[8:]][0] if isinstance(v, str) and v.startswith("ADAPTER:") else v for k, v in body.items()}
    r = lhttp.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert model_ids(lhttp) == [MODEL, "a0", "a1"]
    assert lhttp.get("/health").status_code == 200


@pytest.mark.parametrize("body,status,param", [
    ({"lora_name": "never-loaded"}, 404, "lora_name"),
    ({"lora_int_id": 999}, 404, "lora_int_id"),
    ({"lora_name": "a0", "lora_int_id": 2}, 400, "lora_int_id"),
    ({}, 400, "lora_name"),
])
def test_bad_unloads(lhttp, body, status, param):
    r = lhttp.post("/v1/unload_lora_adapter", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert model_ids(lhttp) == [MODEL, "a0", "a1"]


def test_unloading_an_adapter_in_flight(lclient, lhttp, adapters, tmp_path):
    """A streamed request keeps its adapter when it is unloaded (and its files deleted) mid-stream: same text as
    before, the engine alive, the name gone."""
    path = str(shutil.copytree(adapters["a0"][0], tmp_path / "doomed"))
    assert lhttp.post("/v1/load_lora_adapter", json={"lora_name": "doomed", "lora_path": path}).is_success
    want = complete(lclient, "doomed", PROMPTS[1], max_tokens=64)
    chunks = lclient.completions.create(model="doomed", prompt=PROMPTS[1], max_tokens=64, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    text, unloaded_at = "", None
    for chunk in chunks:
        if not chunk.choices:
            continue
        text += chunk.choices[0].text
        if unloaded_at is None:
            assert lhttp.post("/v1/unload_lora_adapter", json={"lora_name": "doomed"}).is_success
            shutil.rmtree(path)
            unloaded_at = len(text)
        finish = chunk.choices[0].finish_reason
    assert text == want and finish == "length" and unloaded_at < len(want)
    assert lhttp.get("/health").status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(lclient, "doomed", PROMPTS[1])
    assert complete(lclient, "a0", PROMPTS[0]) == adapters["a0"][1][0]


def test_runtime_routes_absent_by_default(http):
    """The shared server runs without VLLM_ALLOW_RUNTIME_LORA_UPDATING: the routes are 404 with an OpenAI body."""
    for route in ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]:
        r = http.post(route, json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


@pytest.mark.slow
def test_a_bad_startup_adapter_stops_the_server(adapters, tmp_path):
    """The engine refuses a --lora-modules adapter: the server exits with a message naming it and the reason."""
    cmd = [sys.executable, "-m", "pagemill.entrypoints.cli", "serve", "--port", str(free_port()),
           "--kv-cache-memory", "64MiB", "--max-model-len", "256", "--enable-lora", "--max-lora-rank", "16",
           "--lora-modules", f"good={adapters['a0'][0]}", f"big={adapters['big'][0]}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pagemill serve: --lora-modules: Cannot load LoRA adapter 'big'"), last
    assert "larger than max_lora_rank (16)" in last
