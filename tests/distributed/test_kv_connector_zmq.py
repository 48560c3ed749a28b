"""ZmqConnector: a prefill engine in another process serves its KV blocks over TCP on loopback, a decode engine
loads them; and P/D end to end with two `pagemill serve` processes behind `pagemill disagg-proxy`."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import time

import httpx
import pytest

from pagemill import SamplingParams
from tests.distributed.test_kv_connector import (BLOCK, GREEDY, PROMPTS, _llm, _prompts, assert_no_leak,
                                                 assert_same_outputs, loadable_tokens)
from tests.entrypoints.conftest import RemoteServer, free_port


def _zmq(role: str, port: int, **extra) -> dict:
    return {"kv_connector": "ZmqConnector", "kv_role": role, "kv_port": port, "kv_connector_extra_config": extra}


def _run_producer(model: str, port: int, prompts: list[list[int]], ready, stop) -> None:
    """The prefill engine (a spawned process): prefill every prompt, report, serve the blocks until told to stop."""
    llm = _llm(model, kv_transfer_config=_zmq("kv_producer", port))
    out = llm.generate(_prompts(prompts), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    stats = llm.get_stats()
    ready.put(([o.outputs[0].token_ids[0] for o in out], stats.num_blocks_free == stats.num_blocks_total))
    stop.wait(120)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return _llm(tiny_llama).generate(_prompts(), GREEDY, use_tqdm=False)


@pytest.mark.parametrize("num_producers", [1, 2])
def test_zmq_disaggregated_prefill_between_processes(tiny_llama, reference, num_producers):
    # 2: two prefill engines, each prefilling every other prompt; the consumer reads from both (2P1D)
    ports = [free_port() for _ in range(num_producers)]
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    producers = [ctx.Process(target=_run_producer, args=(tiny_llama, port, PROMPTS[i::num_producers], ready, stop),
                             daemon=True) for i, port in enumerate(ports)]
    for p in producers:
        p.start()
    try:
        for _ in producers:
            first_tokens, producer_freed_all = ready.get(timeout=120)
            assert producer_freed_all  # its blocks went back to its pool: the served copies live in the buffer
        if num_producers == 1:
            assert first_tokens == [o.outputs[0].token_ids[0] for o in reference]
            kv = _zmq("kv_consumer", ports[0])
        else:
            kv = _zmq("kv_consumer", ports[0], producers=[f"tcp://127.0.0.1:{p}" for p in ports])
        consumer = _llm(tiny_llama, kv_transfer_config=kv)
        out = consumer.generate(_prompts(), GREEDY, use_tqdm=False)
        assert_same_outputs(out, reference)
        stats = consumer.get_stats()
        assert stats.external_prefix_cache_hits == loadable_tokens() > 0
        assert stats.num_prompt_tokens == sum(len(p) for p in PROMPTS) - loadable_tokens()
        assert_no_leak(consumer)
    finally:
        stop.set()
        for p in producers:
            p.join(30)
            if p.is_alive():
                p.kill()


def test_zmq_consumer_without_producer_computes_the_prompt(tiny_llama, reference):
    # nobody serves the port: each lookup times out and the consumer computes the prompts itself
    consumer = _llm(tiny_llama, kv_transfer_config=_zmq("kv_consumer", free_port(), timeout_s=0.2))
    out = consumer.generate(_prompts(PROMPTS[:2]), GREEDY, use_tqdm=False)
    assert_same_outputs(out, reference[:2])
    assert consumer.get_stats().external_prefix_cache_hits == 0
    assert_no_leak(consumer)


@pytest.mark.slow  # ~45 s on a busy 2-core machine: three processes start
def test_pd_servers_behind_the_proxy(tiny_llama, reference, tmp_path):
    """Two real `pagemill serve` processes (prefill: kv_producer, decode: kv_consumer) and the proxy, on loopback."""
    kv_port = free_port()
    common = [tiny_llama, "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--block-size", str(BLOCK),
              "--disable-uvicorn-access-log"]
    prefill = RemoteServer([*common, "--kv-transfer-config", json.dumps(_zmq("kv_producer", kv_port))],
                           tmp_path / "prefill.log")
    decode = RemoteServer([*common, "--kv-transfer-config", json.dumps(_zmq("kv_consumer", kv_port))],
                          tmp_path / "decode.log")
    proxy_port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "pagemill.entrypoints.cli", "disagg-proxy", "--prefill",
                              prefill.url, "--decode", decode.url, "--port", str(proxy_port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{proxy_port}"
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        end = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end and proxy.poll() is None, "the proxy did not come up"
            time.sleep(0.2)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        for prompt, ref in zip(PROMPTS, reference):
            body = {"model": model, "prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0,
                    "ignore_eos": True, "logprobs": 1}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == ref.outputs[0].text
            want = [lp[t].logprob for lp, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids)]
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-4)
        # streamed through the proxy too
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == reference[-1].outputs[0].text
        # a chat request through the proxy answers as the prefill instance alone does (it computes everything)
        chat = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea. " * 8}],
                "max_completion_tokens": 10, "temperature": 0, "ignore_eos": True}
        via_proxy = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()
        alone = httpx.post(prefill.url + "/v1/chat/completions", json=chat, timeout=60).json()
        assert via_proxy["choices"][0]["message"] == alone["choices"][0]["message"]
        assert via_proxy["usage"]["completion_tokens"] == 10
        chat_tokens = (via_proxy["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK
        m = decode.wait_idle()  # and no KV block leaked on either side
        prefill.wait_idle()
        # the decode instance loaded every full prompt block instead of computing it (the streamed repeat of the
        # last prompt: from its own prefix cache)
        assert m["pagemill:external_prefix_cache_hits_total"] == loadable_tokens() + chat_tokens
        assert m["pagemill:prefix_cache_hits_total"] == loadable_tokens(PROMPTS[-1:])
    finally:
        proxy.terminate()
        proxy.wait(10)
        prefill.stop()
        decode.stop()
