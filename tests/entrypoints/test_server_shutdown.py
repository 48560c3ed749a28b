"""How a real `pagemill serve` ends: SIGTERM drains (requests in flight finish or get a well-formed error, exit 0),
a second signal exits at once, and a dead engine core fails every request and makes the server exit non-zero."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.conftest import RemoteServer, engine_core_pid

LONG = {"messages": [{"role": "user", "content": "Count to a million."}], "max_tokens": 3000, "ignore_eos": True,
        "temperature": 0}
SHORT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def start_server(tmp_path, *extra: str) -> RemoteServer:
    """A server for one test (its log under tmp_path)."""
    srv = RemoteServer(["--kv-cache-memory", "256MiB", "--max-model-len", "4096", "--disable-uvicorn-access-log",
                        *extra], tmp_path / "server.log")
    srv.wait_healthy()
    srv.core_pid = engine_core_pid(srv.proc.pid)
    return srv


class Call(threading.Thread):
    """One chat request in a thread; keeps the status, the JSON body or the SSE events, and when it ended."""

    def __init__(self, url: str, body: dict, stream: bool) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.stream = url, {**body, "stream": stream}, stream
        self.status: int | None = None
        self.json: dict | None = None
        self.events: list[str] = []
        self.error: str | None = None
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=120) as c:
                if self.stream:
                    with c.stream("POST", self.url + "/v1/chat/completions", json=self.body) as r:
                        self.status = r.status_code
                        self.events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
                else:
                    r = c.post(self.url + "/v1/chat/completions", json=self.body)
                    self.status, self.json = r.status_code, r.json()
        except Exception as e:  # noqa: BLE001 - recorded for the assertion message
            self.error = repr(e)
        self.ended_at = time.monotonic()

    def check_complete(self) -> None:
        """A full answer: 200 and a finish reason (a stream ends with [DONE] after its last chunk)."""
        assert self.error is None and self.status == 200, (self.error, self.status, self.json)
        if self.stream:
            assert self.events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in self.events[:-1]]
            assert "error" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] is not None
        else:
            assert self.json["choices"][0]["finish_reason"] is not None

    def check_failed(self, status: int) -> None:
        """A well-formed error: a JSON error body, or (streamed) an error event followed by [DONE]."""
        assert self.error is None, self.error
        if self.stream:
            assert self.status == 200 and self.events[-1] == "[DONE]", self.events[-3:]
            err = json.loads(self.events[-2])["error"]
        else:
            assert self.status == status, (self.status, self.json)
            err = self.json["error"]
        assert err["code"] == status and err["message"], err


def wait_running(srv: RemoteServer, n: int, timeout_s: float = 60.0) -> None:
    """Until n requests are running in the engine."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if srv.metrics()["pagemill:num_requests_running"] >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} requests not running after {timeout_s}s")


def test_sigterm_drains_then_ends_requests_with_errors(tmp_path):
    srv = start_server(tmp_path, "--shutdown-timeout", "2")
    try:
        long_calls = [Call(srv.url, LONG, stream) for stream in (True, False, True, False)]
        for c in long_calls:
            c.start()
        wait_running(srv, 4)
        short = [Call(srv.url, SHORT, stream) for stream in (True, False)]
        for c in short:
            c.start()
        time.sleep(0.2)  # the short ones are in
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no new connections once draining
            httpx.get(srv.url + "/health", timeout=5)
        code = srv.proc.wait(30)
        for c in long_calls + short:
            c.join(30)
        assert code == 0, srv.log_tail()
        for c in short:
            c.check_complete()
        for c in long_calls:
            c.check_failed(503)
            assert 1.5 < c.ended_at - t0 < 8.0, c.ended_at - t0  # after the 2 s drain, not at once
        log = srv.log_path.read_text()
        assert "Traceback" not in log and "Shutdown timeout: ended 4 request(s)" in log, log[-3000:]
        assert not os.path.exists(f"/proc/{srv.core_pid}") or \
            open(f"/proc/{srv.core_pid}/stat").read().split()[2] == "Z"
    finally:
        srv.stop()


def test_second_signal_exits_at_once(tmp_path):
    srv = start_server(tmp_path, "--shutdown-timeout", "60")
    try:
        calls = [Call(srv.url, LONG, True) for _ in range(2)]
        for c in calls:
            c.start()
        wait_running(srv, 2)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert srv.proc.poll() is None  # draining: up to 60 s
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        srv.proc.wait(15)
        assert time.monotonic() - t0 < 10
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


def test_engine_core_death_fails_requests_and_exits_non_zero(tmp_path):
    srv = start_server(tmp_path)
    try:
        calls = [Call(srv.url, LONG, stream) for stream in (True, False, True)]
        for c in calls:
            c.start()
        wait_running(srv, 3)
        t0 = time.monotonic()
        os.kill(srv.core_pid, signal.SIGKILL)
        for c in calls:
            c.join(30)
        for c in calls:
            c.check_failed(500)
            assert c.ended_at - t0 < 5.0
        code = srv.proc.wait(30)
        assert code not in (0, None), srv.log_tail()
        assert "the engine core died" in srv.log_path.read_text()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
