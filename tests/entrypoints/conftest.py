"""A real `pagemill serve` subprocess on 127.0.0.1 (default SmolLM2, 256 MiB of KV cache), shared by the modules."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

API_KEY = "sk-pagemill-test"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (from /proc)."""
    out: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        out += [int(p) for p in children.read_text().split()]
    return out


def engine_core_pid(server_pid: int) -> int:
    """The engine core process of a server (its multiprocessing-spawned child)."""
    for pid in child_pids(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except FileNotFoundError:
            continue
        if "spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no engine core child under pid {server_pid}")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (with the model_name label dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "").replace(",}", "}")
        out[name] = float(value)
    return out


class RemoteServer:
    """`python -m pagemill.entrypoints.cli serve ...` in a subprocess, stopped with SIGTERM."""

    def __init__(self, extra_args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "pagemill.entrypoints.cli", "serve", "--port", str(self.port), *extra_args]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log_tail(self, n: int = 4000) -> str:
        """The end of the server's log."""
        return self.log_path.read_text()[-n:]

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        """Block until GET /health answers 200."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"server not healthy after {timeout_s}s:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """The parsed /metrics."""
        r = httpx.get(self.url + "/metrics", timeout=10)
        r.raise_for_status()
        return parse_metrics(r.text)

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and the KV pool is entirely free; returns the metrics."""
        end = time.monotonic() + timeout_s
        m: dict[str, float] = {}
        while time.monotonic() < end:
            m = self.metrics()
            if (m["pagemill:num_requests_running"] == 0 and m["pagemill:num_requests_waiting"] == 0
                    and m["pagemill:num_requests_swapped"] == 0
                    and m["pagemill:kv_cache_free_blocks"] == m["pagemill:kv_cache_total_blocks"]):
                return m
            time.sleep(0.1)
        raise AssertionError(f"server not idle after {timeout_s}s: {m}")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait, and return the exit code (kills it if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"server ignored SIGTERM for {timeout_s}s:\n{self.log_tail()}")
        return self.proc.returncode


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> RemoteServer:
    """One server for the entrypoint test modules; teardown checks the graceful SIGTERM shutdown."""
    srv = RemoteServer(["--kv-cache-memory", "256MiB", "--max-model-len", str(MAX_MODEL_LEN),
                        "--api-key", API_KEY, "--disable-uvicorn-access-log", "--trust-request-chat-template",
                        "--chat-template-timeout", "2", "--enable-tokenizer-info-endpoint"],
                       tmp_path_factory.mktemp("server") / "server.log")
    try:
        srv.wait_healthy()
        srv.core_pid = engine_core_pid(srv.proc.pid)
    except BaseException:
        srv.stop()
        raise
    yield srv
    # uvicorn re-raises the SIGTERM it handled once the graceful shutdown is complete
    assert srv.stop() in (0, -signal.SIGTERM), srv.log_tail()
    assert "Application shutdown complete" in srv.log_path.read_text()
    assert not Path(f"/proc/{srv.core_pid}").exists() or \
        Path(f"/proc/{srv.core_pid}/stat").read_text().split()[2] == "Z", "engine core outlived the server"
    assert "Shutting down the engine core" in srv.log_path.read_text()


@pytest.fixture(scope="session")
def client(server):
    """A synchronous openai client for the server."""
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def http(server):
    """An httpx client with the API key set."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c
