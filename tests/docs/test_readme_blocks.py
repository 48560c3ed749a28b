"""Every code block of the README and the quick start marked runnable runs as written, on the real default model.

A fenced block preceded by `<!-- runnable -->` runs as is (python or bash); one marked `<!-- runnable: server -->`
runs while a `pagemill serve` of the default model listens (the test's free port replaces 8000 in the block)."""

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

ROOT = Path(__file__).resolve().parents[2]
FILES = ("README.md", "docs/getting_started/quickstart.md")
BLOCK = re.compile(r"<!-- runnable(?P<server>: server)? -->\s*\n```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.S)


def runnable_blocks() -> list[tuple[str, bool, str]]:
    """(language, needs a server, code) of every marked block, each distinct block once."""
    seen, out = set(), []
    for name in FILES:
        for m in BLOCK.finditer((ROOT / name).read_text(encoding="utf-8")):
            key = (m["lang"], bool(m["server"]), m["code"])
            if key not in seen:
                seen.add(key)
                out.append(key)
    return out


def _env() -> dict[str, str]:
    # The checkout's package, and the interpreter's scripts (pagemill) first on PATH.
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}


def _run(lang: str, code: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def test_there_are_runnable_blocks():
    blocks = runnable_blocks()
    assert any(not server for _, server, _ in blocks) and any(server for _, server, _ in blocks)
    assert all(lang in ("python", "bash") for lang, _, _ in blocks)


@pytest.mark.slow
@pytest.mark.parametrize("lang,code", [(lang, code) for lang, server, code in runnable_blocks() if not server])
def test_offline_block_runs(lang, code):
    proc = _run(lang, code)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "capital of France" in code:
        assert "Paris" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def server_port(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("readme_server") / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pagemill.entrypoints.cli", "serve", "--port", str(port),
                                 "--kv-cache-memory", "256MiB", "--max-model-len", "2048"], cwd=ROOT, env=_env(), stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.5)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("lang,code", [(lang, code) for lang, server, code in runnable_blocks() if server])
def test_server_block_runs(lang, code, server_port):
    proc = _run(lang, code.replace("127.0.0.1:8000", f"127.0.0.1:{server_port}"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip()
