"""`bench serve` end to end against the real `pagemill serve`."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from pagemill.benchmarks.cli import build_parser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, log_path, deadline_s: float) -> None:
    import httpx

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"server not healthy after {deadline_s}s:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pagemill.entrypoints.cli", "serve",
                                 "--port", str(port), "--kv-cache-memory", "256MiB",
                                 "--max-model-len", "2048", "--disable-uvicorn-access-log"],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log_path, deadline_s=60)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_bench_serve_completions_json_and_png(server_url, tmp_path):
    import matplotlib.image

    result, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", server_url, "--num-prompts", "8",
        "--random-input-len", "24", "--random-output-len", "8", "--request-rate", "16",
        "--max-concurrency", "8", "--goodput", "e2el:60000", "--metric-percentiles", "50,99",
        "--save-result", str(result), "--plot", str(plot), "--save-detailed", "--disable-tqdm"])
    args.func(args)
    data = json.loads(result.read_text())
    (run,) = data["runs"]
    assert run["completed"] == 8 and run["failed"] == 0, run.get("error_samples")
    assert run["total_output_tokens"] == 8 * 8  # ignore_eos honoured, usage or chunk count
    assert run["total_input_tokens"] >= 8 * 24
    assert 0 < run["ttft_ms"]["mean"] <= run["e2el_ms"]["mean"]
    assert run["tpot_ms"]["mean"] > 0 and run["itl_ms"]["p99"] >= run["itl_ms"]["p50"]
    assert run["normalized_latency_s_per_token"] > 0 and run["request_goodput"] > 0
    assert data["environment"]["cpu_cores"] and data["config"]["num_prompts"] == 8
    assert len(run["requests"]["ttfts_s"]) == 8
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(str(plot)).ndim == 3


def test_bench_serve_chat_endpoint(server_url, tmp_path):
    result = tmp_path / "chat.json"
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", server_url, "--endpoint", "/v1/chat/completions",
        "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4",
        "--save-result", str(result), "--disable-tqdm", "--skip-initial-test"])
    args.func(args)
    (run,) = json.loads(result.read_text())["runs"]
    assert run["completed"] == 2 and run["failed"] == 0, run.get("error_samples")
    assert run["total_output_tokens"] == 8
    assert run["total_input_tokens"] > 2 * 8  # the chat template adds tokens


def test_bench_serve_structured_output_constrained_vs_unconstrained(server_url, tmp_path):
    """One run sends the regex request set with its constraints, then the same prompts without them for the same
    number of tokens: both tables, valid outputs, the TPOT ratio."""
    result = tmp_path / "so.json"
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", server_url, "--structured-output", "regex", "--num-prompts", "4",
        "--random-output-len", "48", "--max-concurrency", "4", "--save-result", str(result), "--disable-tqdm"])
    args.func(args)
    data = json.loads(result.read_text())
    constrained, plain = data["runs"]
    assert (constrained["target"], plain["target"]) == ("constrained", "unconstrained")
    for run in (constrained, plain):
        assert run["completed"] == 4 and run["failed"] == 0, run.get("error_samples")
        assert run["tpot_ms"]["mean"] > 0
    assert constrained["valid_outputs"] == 4  # the server honoured vLLM's structured_outputs field
    assert constrained["warmup_compile_s"] > 0 and constrained["warmup_cached_s"] > 0
    assert plain["total_output_tokens"] == constrained["total_output_tokens"]  # the same tokens, unconstrained
    assert data["ratio"]["mean_tpot"] == pytest.approx(constrained["tpot_ms"]["mean"] / plain["tpot_ms"]["mean"])
