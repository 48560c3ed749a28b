"""guidellm (unmodified) benchmarks a real `pagemill serve` given only its address: the model name comes from
/v1/models and the tokenizer from the server itself (HF_ENDPOINT, the Hub file routes)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.entrypoints.conftest import RemoteServer

NUM_REQUESTS = 4


@pytest.mark.slow
def test_guidellm_synthetic_benchmark(tiny_llama, tmp_path):
    guidellm = shutil.which("guidellm") or os.path.join(os.path.dirname(sys.executable), "guidellm")
    if not os.path.exists(guidellm):
        pytest.fail("guidellm is not installed: pip install -e '.[test]'", pytrace=False)
    srv = RemoteServer([tiny_llama, "--kv-cache-memory", "64MiB", "--max-model-len", "512"],
                       tmp_path / "server.log")
    report = tmp_path / "report.json"
    try:
        srv.wait_healthy()
        env = {**os.environ, "HF_ENDPOINT": srv.url, "HF_HOME": str(tmp_path / "hf"),
               "HF_HUB_DISABLE_TELEMETRY": "1"}
        for offline in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # offline mode would skip HF_ENDPOINT
            env.pop(offline, None)
        run = subprocess.run(
            [guidellm, "run", "--backend", f"kind=openai_http,target={srv.url}",
             "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
             "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
             "--output", f"kind=json,path={report}", "--disable-console-interactive"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    name = os.path.basename(tiny_llama)  # the served name guidellm found in /v1/models: the tokenizer came from us
    assert re.search(rf'"GET /{re.escape(name)}/resolve/[0-9a-f]{{40}}/tokenizer.json HTTP/1.1" 200', log), log[-3000:]
    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert len(benchmarks) == 1
    totals = benchmarks[0]["metrics"]["request_totals"]
    assert totals == {"successful": NUM_REQUESTS, "errored": 0, "incomplete": 0, "total": NUM_REQUESTS}
    assert benchmarks[0]["metrics"]["output_token_count"]["successful"]["total_sum"] > 0
