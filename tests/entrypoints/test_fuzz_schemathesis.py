"""Schemathesis (`--checks all`) against a real `pagemill serve`: no 5xx, every answer as documented in
/openapi.json, schema-violating requests refused (about 2,000 generated requests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.conftest import RemoteServer

FUZZ_DIR = Path(__file__).parent / "fuzz"
MAX_EXAMPLES = int(os.environ.get("PAGEMILL_FUZZ_EXAMPLES", "60"))  # per operation; 60 gives ~2,000 requests


@pytest.mark.slow
def test_schemathesis_finds_nothing(tmp_path):
    srv = RemoteServer(["--kv-cache-memory", "128MiB", "--max-model-len", "512", "--disable-uvicorn-access-log",
                        "--max-request-body-bytes", str(2**20), "--enable-tokenizer-info-endpoint"],
                       tmp_path / "server.log")
    try:
        srv.wait_healthy()
        cli = Path(sys.executable).with_name("schemathesis")
        result = subprocess.run(
            [str(cli), "--config-file", str(FUZZ_DIR / "schemathesis.toml"), "run", srv.url + "/openapi.json",
             # (ensure_resource_availability: a response created with "store": false is not retrievable by design)
             "--checks", "all", "--exclude-checks", "ensure_resource_availability", "--max-examples", str(MAX_EXAMPLES), "--seed", "0", "--request-timeout", "60",
             "--generation-database", "none", "--no-color"],
            env={**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
                 "PYTHONPATH": f"{FUZZ_DIR}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
            capture_output=True, text=True, timeout=1200, cwd=tmp_path)  # (its .schemathesis cache goes there)
        report = result.stdout[-6000:] + result.stderr[-2000:]
        assert result.returncode == 0, report
        assert "generated" in report and "failure" not in report.rpartition("SUMMARY")[2], report
        srv.wait_idle()
    finally:
        code = srv.stop()
    assert code == 0, srv.log_tail()
    assert "Traceback" not in srv.log_path.read_text(), srv.log_tail()
