"""Arrival process, request bodies, model-name choice, plots, result files and CLI wiring."""

import json
import math

import numpy as np
import pytest

from pagemill.benchmarks.cli import build_parser
from pagemill.benchmarks.datasets import SampleRequest
from pagemill.benchmarks.openai_client import build_payload
from pagemill.benchmarks.plots import plot_sweep
from pagemill.benchmarks.report import environment_info, format_table, save_result
from pagemill.benchmarks.serve_load import arrival_times, choose_model_name


def test_poisson_arrivals_have_the_requested_rate():
    t = arrival_times(20_000, rate=4.0, burstiness=1.0, rng=np.random.default_rng(0))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1


def test_burstiness_changes_variance_not_rate():
    bursty = np.diff(arrival_times(20_000, 4.0, 0.25, np.random.default_rng(0)))
    smooth = np.diff(arrival_times(20_000, 4.0, 4.0, np.random.default_rng(0)))
    for gaps in (bursty, smooth):
        assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    # gamma shape k: CV = 1/sqrt(k)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)
    assert smooth.std() / smooth.mean() == pytest.approx(0.5, rel=0.05)


def test_infinite_rate_and_validation():
    assert arrival_times(3, math.inf, 1.0, np.random.default_rng(0)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, 1.0, np.random.default_rng(0))
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, 0.0, np.random.default_rng(0))


def test_payloads():
    s = SampleRequest("Hi there", 2, 17, [1, 2])
    body = build_payload(s, "m", chat=False, ignore_eos=True, temperature=0.0)
    assert body["prompt"] == "Hi there" and body["max_tokens"] == 17 and body["stream"] is True
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    chat = build_payload(s, "m", chat=True, ignore_eos=False, temperature=0.5,
                         extra_body={"top_k": 3})
    assert chat["messages"] == [{"role": "user", "content": "Hi there"}]
    assert chat["max_completion_tokens"] == 17 and chat["top_k"] == 3 and "prompt" not in chat


def test_choose_model_name():
    parser = build_parser()
    args = parser.parse_args(["bench", "serve"])
    assert choose_model_name(args, ["served"]) == "served"
    args = parser.parse_args(["bench", "serve", "--model", "b"])
    assert choose_model_name(args, ["a", "b"]) == "b"
    args = parser.parse_args(["bench", "serve", "--served-model-name", "x"])
    assert choose_model_name(args, ["a"]) == "x"


def test_cli_registers_three_commands_with_vllm_flag_names():
    parser = build_parser()
    args = parser.parse_args(["bench", "throughput", "--dataset-name", "sharegpt",
                              "--num-prompts", "5", "--compare", "hf", "--seed", "3"])
    assert (args.dataset_name, args.num_prompts, args.compare, args.seed) == ("sharegpt", 5, "hf", 3)
    assert callable(args.func) and args.backend == "pagemill" and args.model is None
    args = parser.parse_args(["bench", "latency", "--batch-size", "1", "--output-json", "x.json"])
    assert args.batch_size == 1 and args.save_result == "x.json"
    args = parser.parse_args(["bench", "serve", "--request-rate", "2", "--max-concurrency", "4",
                              "--sweep-rates", "1,2", "--plot", "p.png", "--goodput", "ttft:100",
                              "tpot:20", "--random-range-ratio", "0.1"])
    assert args.request_rate == 2.0 and args.max_concurrency == 4 and args.goodput == ["ttft:100", "tpot:20"]
    assert args.base_url == "http://127.0.0.1:8000" and args.ignore_eos is True
    with pytest.raises(SystemExit):
        parser.parse_args(["bench"])


def test_plot_sweep_writes_png(tmp_path):
    import matplotlib.image

    runs = [{"request_rate": r, "normalized_latency_s_per_token": 0.01 * i,
             "output_throughput": 10.0 * i} for i, r in enumerate([1.0, 2.0, math.inf], 1)]
    path = tmp_path / "sweep.png"
    plot_sweep({"pagemill": runs, "baseline": runs[:2]}, str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(str(path)).shape[0] > 100


def test_save_result_and_environment(tmp_path):
    env = environment_info()
    assert env["cpu_cores"] and env["torch"] and "date_utc" in env
    assert env["pagemill_env"]["cpu"]["flags"] and "kernels" in env["pagemill_env"]
    path = tmp_path / "sub" / "r.json"
    save_result(str(path), {"rate": math.inf, "x": [1.5, np.int64(3)], "env": env})
    data = json.loads(path.read_text())
    assert data["rate"] == "inf" and data["x"] == [1.5, 3]


def test_format_table():
    text = format_table("T", [("Requests", 3), ("Rate", 1.23456), ("--Section", "")])
    assert "Requests:" in text and "1.23" in text and "Section" in text


def test_serve_table_lists_every_metric_family():
    from pagemill.benchmarks.metrics import RequestResult, compute_metrics
    from pagemill.benchmarks.serve_report import serve_table

    results = [RequestResult(0.0, [0.1, 0.2, 0.35], 3, 10, True)]
    metrics = compute_metrics(results, 1.0, [50, 99], {"ttft": 200})
    metrics["request_rate"] = math.inf
    text = serve_table(metrics, ["50", "99"], "Serving Benchmark Result")
    for needle in ("Successful requests:", "Request goodput", "Mean TTFT (ms):", "P99 TPOT",
                   "P50 ITL", "Median E2EL", "Normalized latency (s/token):", "inf"):
        assert needle in text
