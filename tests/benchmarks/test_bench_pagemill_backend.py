"""`bench throughput/latency --backend pagemill --compare hf` end to end on a tiny random Llama."""

import json

import pytest

from pagemill.benchmarks.cli import build_parser
from pagemill.benchmarks.pagemill_backend import engine_kwargs, parse_engine_args


def test_engine_kwargs_pass_only_given_flags():
    args = build_parser().parse_args(["bench", "throughput", "--max-num-seqs", "4", "--dtype",
                                      "float32", "--engine-arg", "seed=3",
                                      "--engine-arg", "tokenizer=/x"])
    assert engine_kwargs(args, "m") == {"model": "m", "dtype": "float32", "max_num_seqs": 4,
                                        "seed": 3, "tokenizer": "/x"}
    assert parse_engine_args(["a=[1, 2]", "b=True"]) == {"a": [1, 2], "b": True}
    with pytest.raises(ValueError):
        parse_engine_args(["novalue"])


def test_throughput_compare_hf_matches_greedy_tokens(tiny_model, tmp_path):
    out = tmp_path / "tp.json"
    args = build_parser().parse_args([
        "bench", "throughput", "--model", tiny_model, "--compare", "hf", "--num-prompts", "6",
        "--random-input-len", "24", "--random-output-len", "10", "--random-range-ratio", "0.5",
        "--max-num-seqs", "4", "--dtype", "float32", "--num-iters", "2", "--disable-tqdm",
        "--save-result", str(out)])
    args.func(args)
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"pagemill", "hf"}
    ours = data["results"]["pagemill"]
    assert ours["total_output_tokens"] == ours["requested_output_tokens"]
    assert len(ours["elapsed_all_s"]) == 2
    assert data["ratio"]["output_tokens_per_s"] == pytest.approx(
        ours["output_tokens_per_s"] / data["results"]["hf"]["output_tokens_per_s"])
    assert data["agreement"]["identical_requests"] == 6  # fp32 greedy == transformers


def test_latency_compare_hf(tiny_model, tmp_path):
    out = tmp_path / "lat.json"
    args = build_parser().parse_args([
        "bench", "latency", "--model", tiny_model, "--compare", "hf", "--batch-size", "1",
        "--input-len", "8", "--output-len", "5", "--num-iters-warmup", "1", "--num-iters", "2",
        "--save-result", str(out)])
    args.func(args)
    data = json.loads(out.read_text())
    assert {"avg_latency", "ttft", "decode_per_token"} <= set(data["speedup"])
    assert data["results"]["pagemill"]["ttft_s"] > 0
