"""The hf baseline backend and the throughput/latency commands, on a tiny random Llama."""

import json

import pytest

from pagemill.benchmarks.cli import build_parser
from pagemill.benchmarks.hf_backend import HFBackend, plan_batches
from pagemill.benchmarks.throughput import agreement


def test_plan_batches_groups_similar_lengths():
    batches = plan_batches([5, 100, 6, 90, 7], [1, 1, 1, 1, 1], 2)
    assert batches == [[0, 2], [4, 3], [1]]
    with pytest.raises(ValueError):
        plan_batches([1], [1], 0)


def test_hf_backend_exact_lengths_in_input_order(tiny_model):
    backend = HFBackend(tiny_model, batch_size=2)
    prompts = [[10, 11, 12], [20, 21], [30, 31, 32, 33], [40]]
    outs = backend.generate(prompts, [3, 8, 5, 1])
    assert [len(o) for o in outs] == [3, 8, 5, 1]
    # batches: (1 token, 3 tokens) -> 2*3 generated, (5, 8) -> 2*8 generated
    assert backend.generated_tokens == 6 + 16
    alone = backend.generate([prompts[1]], [8])
    assert alone[0][:1] == outs[1][:1]


def test_agreement():
    a = agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]])
    assert a["identical_requests"] == 1
    assert a["mean_common_prefix_fraction"] == pytest.approx((1 + 0.5) / 2)


def test_bench_throughput_hf_end_to_end(tiny_model, tmp_path, capsys):
    out = tmp_path / "tp.json"
    args = build_parser().parse_args([
        "bench", "throughput", "--backend", "hf", "--model", tiny_model, "--num-prompts", "6",
        "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "0.5",
        "--hf-batch-size", "4", "--save-result", str(out), "--disable-tqdm"])
    args.func(args)
    data = json.loads(out.read_text())
    res = data["results"]["hf"]
    assert res["num_requests"] == 6
    assert res["total_output_tokens"] == res["requested_output_tokens"]
    assert res["output_tokens_per_s"] == pytest.approx(res["total_output_tokens"] / res["elapsed_s"])
    assert data["config"]["num_prompts"] == 6 and data["environment"]["cpu_cores"]
    assert data["environment"]["load_avg_1m_at_start"] is not None
    assert "Throughput: hf" in capsys.readouterr().out


def test_bench_latency_hf_batch_one(tiny_model, tmp_path):
    out = tmp_path / "lat.json"
    args = build_parser().parse_args([
        "bench", "latency", "--backend", "hf", "--model", tiny_model, "--batch-size", "1",
        "--input-len", "8", "--output-len", "6", "--num-iters-warmup", "1", "--num-iters", "3",
        "--save-result", str(out)])
    args.func(args)
    res = json.loads(out.read_text())["results"]["hf"]
    assert len(res["latencies_s"]) == 3
    assert res["p10_s"] <= res["p50_s"] <= res["p99_s"]
    assert 0 < res["ttft_s"] and res["decode_s_per_token"] == pytest.approx(
        (res["avg_s"] - res["ttft_s"]) / 5)


def test_interleaved_times_runs_every_backend(tiny_model):
    from pagemill.benchmarks.backends import interleaved_times

    backends = {"a": HFBackend(tiny_model, 2), "b": HFBackend(tiny_model, 2)}
    times, last = interleaved_times(backends, lambda b: b.generate([[5, 6, 7]], [4]), 3)
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t > 0 for v in times.values() for t in v)
    assert last["a"] == last["b"] and len(last["a"][0]) == 4
