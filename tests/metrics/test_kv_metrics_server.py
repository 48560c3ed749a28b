"""A real `pagemill serve` (tiny random Llama, two-level scheduling) on 127.0.0.1: the KV accounting in /metrics,
and the expected_output_tokens request field."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import RemoteServer

NUM_BLOCKS = 256
BLOCK = 4


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = RemoteServer([tiny_llama, "--scheduling-policy", "two-level", "--scheduling-staging-size", "4",
                        "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(NUM_BLOCKS),
                        "--max-model-len", "256", "--disable-uvicorn-access-log"],
                       tmp_path_factory.mktemp("kv_server") / "server.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def _complete(server: RemoteServer, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"prompt": "The KV cache of a paged engine " * 6,
                                                            "max_tokens": 6, "ignore_eos": True, **body}, timeout=60)


def test_metrics_carry_the_kv_accounting(server):
    before = server.metrics()
    assert before["pagemill:kv_cache_prefix_hit_rate"] == 0
    for _ in range(2):  # the second finds the first's full prompt blocks in the prefix cache
        r = _complete(server, expected_output_tokens=3)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6  # a hint orders the queue; it never cuts the output
    m = server.wait_idle()
    assert m["pagemill:kv_cache_total_slots"] == (NUM_BLOCKS - 1) * BLOCK  # the accounting reached the front end
    assert m["pagemill:kv_cache_token_slots"] == 0 and m["pagemill:kv_cache_fragmented_slots"] == 0
    assert m["pagemill:kv_cache_shared_blocks"] == 0 and m["pagemill:kv_cache_sharing_saved_bytes"] == 0
    assert 0.3 < m["pagemill:kv_cache_prefix_hit_rate"] < 0.5  # about half the tokens looked up were found
    assert m["pagemill:prefix_cache_hits_total"] > 0


def test_expected_output_tokens_is_validated(server):
    r = _complete(server, expected_output_tokens=-1)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "expected_output_tokens"
