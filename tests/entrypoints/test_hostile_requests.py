"""Requests meant to take the server down: each gets a 400/413 naming the field, /health keeps answering within a
second while it runs, and afterwards nothing runs and the KV pool is empty (issue 21's table, on a real server)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, RemoteServer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
RUNAWAY_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
BODY_LIMIT = 4 * 2**20


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory):
    """A server with the default limits (no request chat templates), a 4 MiB body limit and no API key."""
    srv = RemoteServer(["--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--disable-uvicorn-access-log",
                        "--max-request-body-bytes", str(BODY_LIMIT)],
                       tmp_path_factory.mktemp("hostile") / "server.log")
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    yield srv
    assert srv.stop() == 0, srv.log_tail()
    assert "Traceback" not in srv.log_path.read_text(), srv.log_tail()


def raw(text: str) -> bytes:
    """A JSON body written by hand (lone surrogates and huge numbers that json.dumps would not write)."""
    return text.encode()


# (case id, path, body (dict, or raw bytes), status, param, text the message must contain)
CASES = [
    ("n_billion", CHAT, {"messages": HI, "n": 1_000_000_000, "max_tokens": 1}, 400, "n", "at most"),
    ("best_of_billion", COMPLETIONS, {"prompt": "hi", "n": 1, "best_of": 10**9}, 400, "best_of", ""),
    ("request_chat_template_refused", CHAT, {"messages": HI, "chat_template": RUNAWAY_TEMPLATE}, 400,
     "chat_template", "--trust-request-chat-template"),
    ("tokenize_chat_template_refused", "/tokenize", {"messages": HI, "chat_template": RUNAWAY_TEMPLATE}, 400,
     "chat_template", "--trust-request-chat-template"),
    ("prompt_10mb", COMPLETIONS, {"prompt": "lorem ipsum dolor " * (3 * 2**20 // 18), "max_tokens": 1}, 400, "prompt",
     "maximum context length"),
    ("body_over_limit", COMPLETIONS, {"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1}, 413, None,
     "--max-request-body-bytes"),
    ("logprobs_49152", COMPLETIONS, {"prompt": "hi", "max_tokens": 64, "logprobs": 49152}, 400, "logprobs",
     "--max-logprobs"),
    ("top_logprobs_over_limit", CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "--max-logprobs"),
    ("seed_2_64_minus_1_n2", COMPLETIONS, raw('{"prompt": "hi", "max_tokens": 4000, "n": 2, '
                                              '"seed": 18446744073709551615}'), 400, "seed", "64-bit"),
    ("seed_below_int64", COMPLETIONS, raw('{"prompt": "hi", "seed": -9223372036854775809}'), 400, "seed", "64-bit"),
    ("priority_huge", COMPLETIONS, raw('{"prompt": "hi", "priority": 99999999999999999999}'), 400, "priority",
     "64-bit"),
    ("stop_token_id_huge", COMPLETIONS, raw('{"prompt": "hi", "stop_token_ids": [1, 99999999999999999999]}'), 400,
     "stop_token_ids.1", "64-bit"),
    ("surrogate_prompt", COMPLETIONS, raw('{"prompt": "a\\ud800b"}'), 400, "prompt", "surrogate"),
    ("surrogate_prompt_list", COMPLETIONS, raw('{"prompt": ["ok", "a\\udfffb"]}'), 400, "prompt.1", "surrogate"),
    ("surrogate_message", CHAT, raw('{"messages": [{"role": "user", "content": "a\\ud800b"}]}'), 400,
     "messages.0.content", "surrogate"),
    ("surrogate_tokenize", "/tokenize", raw('{"prompt": "a\\ud800b"}'), 400, "prompt", "surrogate"),
    ("surrogate_stop", COMPLETIONS, raw('{"prompt": "hi", "stop": ["\\ud800"]}'), 400, "stop.0", "surrogate"),
    ("surrogate_cache_salt", COMPLETIONS, raw('{"prompt": "hi", "cache_salt": "\\udc00"}'), 400, "cache_salt",
     "surrogate"),
    ("temperature_infinity", COMPLETIONS, raw('{"prompt": "hi", "temperature": Infinity}'), 400, "temperature",
     "finite"),
    ("temperature_nan", CHAT, raw('{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'), 400,
     "temperature", "finite"),
    ("repetition_penalty_infinity", COMPLETIONS, raw('{"prompt": "hi", "repetition_penalty": Infinity}'), 400,
     "repetition_penalty", "finite"),
    ("top_k_minus_5", COMPLETIONS, {"prompt": "hi", "top_k": -5}, 400, "top_k", ""),
]


class HealthProbe:
    """Polls /health every 50 ms in a thread while a hostile request runs; keeps each answer's latency."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t = time.perf_counter()
                try:
                    r = c.get(self.url + "/health")
                    if r.status_code != 200:
                        self.failures.append(f"{r.status_code} {r.text}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                self.latencies.append(time.perf_counter() - t)
                self._stop.wait(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def post(url: str, path: str, body: dict | bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST a JSON body (a dict, or bytes written by hand)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, timeout=120,
                      headers={"Content-Type": "application/json", **(headers or {})})


def check_error(r: httpx.Response, status: int, param: str | None, text: str) -> None:
    """The status, the OpenAI error shape, the `param` and the message."""
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    assert err["param"] == param, err
    assert text.lower() in err["message"].lower(), err


@pytest.mark.parametrize("path,body,status,param,text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_request(hostile_server, path, body, status, param, text):
    with HealthProbe(hostile_server.url) as probe:
        r = post(hostile_server.url, path, body)
    check_error(r, status, param, text)
    assert not probe.failures, probe.failures
    assert max(probe.latencies, default=0.0) < 1.0, sorted(probe.latencies)[-5:]
    hostile_server.wait_idle()
    lat = sorted(probe.latencies)
    print(f"\n/health while {path} ran: {len(lat)} probes, p99 {lat[int(0.99 * (len(lat) - 1))] * 1e3:.1f} ms, "
          f"max {lat[-1] * 1e3:.1f} ms" if lat else "")


def test_runaway_template_is_stopped(server):
    """A server that trusts request chat templates still stops one that renders forever (--chat-template-timeout)."""
    with HealthProbe(server.url) as probe:
        r = post(server.url, CHAT, {"messages": HI, "chat_template": RUNAWAY_TEMPLATE},
                 {"Authorization": f"Bearer {API_KEY}"})
    check_error(r, 400, "chat_template", "--chat-template-timeout")
    assert not probe.failures and max(probe.latencies) < 1.0, (probe.failures, sorted(probe.latencies)[-5:])
    ok = post(server.url, CHAT, {"messages": HI, "max_tokens": 2}, {"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200, ok.text
    server.wait_idle()


def test_largest_seed_fans_out(hostile_server):
    """The largest int64 seed with n = 2: the second sequence's seed wraps around instead of overflowing."""
    r = post(hostile_server.url, COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "n": 2, "seed": 2**63 - 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    hostile_server.wait_idle()


def test_chunked_body_over_limit(hostile_server):
    """A body sent without Content-Length (chunked) is cut off at the limit with a 413."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 2**16 + 2):
            yield b"x" * 2**16
        yield b'"}'

    r = httpx.post(hostile_server.url + COMPLETIONS, content=chunks(), timeout=60,
                   headers={"Content-Type": "application/json"})
    check_error(r, 413, None, "--max-request-body-bytes")
    assert httpx.get(hostile_server.url + "/health", timeout=10).status_code == 200


def test_openapi_is_truthful(hostile_server):
    spec = httpx.get(hostile_server.url + "/openapi.json", timeout=30).json()
    assert "422" not in json.dumps(spec["paths"])
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    chat = spec["paths"][CHAT]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "500", "503"} <= set(chat)
    assert chat["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "text/event-stream" in chat["200"]["content"]
    assert spec["components"]["schemas"]["ErrorResponse"]["properties"]["error"]
    health = httpx.get(hostile_server.url + "/health", timeout=10)
    assert health.json() == {"status": "ok"} and health.headers["content-type"] == "application/json"
    assert "401" not in spec["paths"]["/health"]["get"]["responses"]


def test_method_not_allowed_has_allow_header(hostile_server):
    r = httpx.get(hostile_server.url + CHAT, timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    assert r.json()["error"]["code"] == 405


def test_no_cors_by_default(hostile_server):
    r = httpx.options(hostile_server.url + CHAT, timeout=10, headers={
        "Origin": "https://example.test", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_kv_gauges_before_the_first_request(tmp_path):
    """The KV block gauges show the whole pool free from the start, not 0 until the first request."""
    srv = RemoteServer(["--num-gpu-blocks-override", "64", "--max-model-len", "256", "--disable-uvicorn-access-log",
                        "--allowed-origins", '["https://example.test"]'], tmp_path / "server.log")
    try:
        srv.wait_healthy()
        m = srv.metrics()
        assert m["pagemill:kv_cache_total_blocks"] == m["pagemill:kv_cache_free_blocks"] > 0
        assert m["pagemill:engine_dead"] == 0
        r = httpx.options(srv.url + CHAT, timeout=10, headers={
            "Origin": "https://example.test", "Access-Control-Request-Method": "POST"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://example.test"
    finally:
        assert srv.stop() == 0, srv.log_tail()
