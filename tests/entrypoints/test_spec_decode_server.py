"""`pagemill serve --speculative-config`: the spec_decode counters in /metrics and the per-request opt-out."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import RemoteServer

PROMPT = ("Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry, apple, "
          "banana, cherry.\nList: apple, banana, cherry, apple,")
PER_POS = [f'pagemill:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}' for i in range(4)]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    srv = RemoteServer(["--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--num-threads", "1",
                        "--disable-uvicorn-access-log", "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 4}'],
                       tmp_path_factory.mktemp("spec_server") / "server.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def _complete(srv: RemoteServer, **extra) -> str:
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0.0,
                                                      "ignore_eos": True, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_counters_exist_before_any_request(spec_server):
    m = spec_server.metrics()
    assert m["pagemill:spec_decode_num_drafts_total"] == 0 and [m[k] for k in PER_POS] == [0, 0, 0, 0]


def test_drafts_are_counted_and_the_opt_out_drafts_nothing(spec_server):
    with_spec = _complete(spec_server)
    m = spec_server.wait_idle()
    drafts, draft_tokens = m["pagemill:spec_decode_num_drafts_total"], m["pagemill:spec_decode_num_draft_tokens_total"]
    accepted = m["pagemill:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= draft_tokens <= 4 * drafts
    assert sum(m[k] for k in PER_POS) == accepted
    without = _complete(spec_server, speculative_decoding=False)
    m = spec_server.wait_idle()
    assert m["pagemill:spec_decode_num_drafts_total"] == drafts  # the opted-out request got no drafts
    assert without == with_spec  # greedy: the same text either way
    r = httpx.post(spec_server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "speculative_decoding": "sometimes"})
    assert r.status_code == 400 and "speculative_decoding" in r.text
