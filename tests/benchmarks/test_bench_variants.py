"""`bench throughput|latency --variant NAME="ENGINE FLAGS"`: the same workload under named engine configurations."""

import json

import pytest

from pagemill.benchmarks.cli import build_parser
from pagemill.benchmarks.variants import parse_variants, ratio_lines


def test_parse_variants_keeps_only_the_given_flags():
    variants = parse_variants(['fp16=--linear-dtype float16 --kv-cache-dtype float16',
                               'nocache=--no-enable-prefix-caching --max-num-seqs 4', 'base='])
    assert variants == {"fp16": {"linear_dtype": "float16", "kv_cache_dtype": "float16"},
                        "nocache": {"enable_prefix_caching": False, "max_num_seqs": 4}, "base": {}}
    assert parse_variants(['spec=--speculative-config \'{"method": "ngram", "num_speculative_tokens": 2}\''])[
        "spec"]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    for bad in (["noequals"], ["a=--no-such-flag 1"], ["a=", "a=--seed 1"], ["a=--max-num-seqs x"]):
        with pytest.raises(ValueError):
            parse_variants(bad)


def test_ratio_lines():
    results = {"a": {"t": 2.0}, "b": {"t": 1.0}}
    assert ratio_lines(results, "t", False, "speed") == ["b vs a: 2.000x speed (1 vs 2)"]
    assert ratio_lines(results, "t", True, "tok/s") == ["b vs a: 0.500x tok/s (1 vs 2)"]


def test_throughput_variants_run_interleaved(tiny_model, tmp_path):
    out = tmp_path / "v.json"
    args = build_parser().parse_args([
        "bench", "throughput", "--model", tiny_model, "--num-prompts", "4", "--random-input-len", "16",
        "--random-output-len", "6", "--dtype", "float32", "--num-iters", "2", "--disable-tqdm",
        "--variant", "block16=--block-size 16", "--variant", "block8=--block-size 8 --max-num-seqs 2",
        "--save-result", str(out)])
    args.func(args)
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["variant:block16", "variant:block8"]
    for result in data["results"].values():
        assert len(result["elapsed_all_s"]) == 2
        assert result["total_output_tokens"] == result["requested_output_tokens"]
    assert data["results"]["variant:block8"]["description"] == "pagemill variant block8: --block-size 8 --max-num-seqs 2"
    assert len(data["variant_ratios"]) == 1 and data["variant_ratios"][0].startswith("variant:block8 vs variant:block16")


def test_latency_variants(tiny_model, tmp_path):
    out = tmp_path / "l.json"
    args = build_parser().parse_args([
        "bench", "latency", "--model", tiny_model, "--batch-size", "1", "--input-len", "8", "--output-len", "4",
        "--num-iters-warmup", "0", "--num-iters", "2", "--dtype", "float32",
        "--variant", "a=", "--variant", "b=--no-enable-prefix-caching", "--reset-prefix-cache",
        "--save-result", str(out)])
    args.func(args)
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["variant:a", "variant:b"]
    assert any("decode speed" in line for line in data["variant_ratios"])


def test_latency_variants_print_ratios(tiny_model, capsys):
    args = build_parser().parse_args([
        "bench", "latency", "--model", tiny_model, "--batch-size", "1", "--input-len", "8", "--output-len", "4",
        "--num-iters-warmup", "0", "--num-iters", "2", "--dtype", "float32",
        "--variant", "a=--block-size 16", "--variant", "b=--block-size 8"])
    args.func(args)
    out = capsys.readouterr().out
    assert "variant:b vs variant:a:" in out and "x " in out.split("variant:b vs variant:a:")[1]


def test_serve_variant_parsing_and_abba_order():
    from pagemill.benchmarks.serve_variants import abba_order, parse_serve_variants, variant_ratio_lines

    assert parse_serve_variants(["a=--max-num-seqs 2", "b="]) == {"a": "--max-num-seqs 2", "b": ""}
    for bad in (["noequals"], ["=--seed 1"], ["a=", "a=--seed 2"], ["a=--x 'unclosed"]):
        with pytest.raises(ValueError):
            parse_serve_variants(bad)
    assert abba_order(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    with pytest.raises(ValueError):
        abba_order(["a"], 0)
    lines = variant_ratio_lines({"a": {"output_throughput": 10.0, "normalized_latency_ms": 4.0},
                                 "b": {"output_throughput": 20.0, "normalized_latency_ms": 8.0}})
    assert lines == ["b vs a: 2.000x output tok/s (20 vs 10)", "b vs a: 0.500x normalized latency (8 vs 4)"]


@pytest.mark.slow
def test_serve_variants_on_real_servers(tiny_model, tmp_path, capsys):
    """Two `pagemill serve` variants on loopback, two ABBA rounds of the same few requests, ratios printed."""
    out = tmp_path / "s.json"
    args = build_parser().parse_args([
        "bench", "serve", "--model", tiny_model, "--num-prompts", "3", "--random-input-len", "12",
        "--random-output-len", "5", "--request-rate", "inf", "--disable-tqdm",
        "--pagemill-serve-args", "--block-size 4 --num-gpu-blocks-override 64 --max-model-len 128 "
                                 "--disable-uvicorn-access-log",
        "--variant", "seqs4=--max-num-seqs 4", "--variant", "seqs1=--max-num-seqs 1",
        "--save-result", str(out)])
    args.func(args)
    data = json.loads(out.read_text())
    assert [(r["target"], r["variant_round"]) for r in data["runs"]] == [
        ("seqs4", 0), ("seqs4", 1), ("seqs1", 0), ("seqs1", 1)]
    for run in data["runs"]:
        assert run["completed"] == 3 and run["failed"] == 0, run.get("error_samples")
        assert run["total_output_tokens"] == 3 * 5
    [row] = data["variant_ratios"]
    assert list(row["summaries"]) == ["seqs4", "seqs1"] and len(row["lines"]) == 2
    printed = capsys.readouterr().out
    assert "rate inf: seqs1 vs seqs4:" in printed and "output tok/s" in printed


def test_variant_with_structured_output_is_a_clear_error(tiny_model):
    args = build_parser().parse_args([
        "bench", "throughput", "--model", tiny_model, "--structured-output", "json", "--num-prompts", "1",
        "--variant", "a=", "--variant", "b=--max-num-seqs 2"])
    with pytest.raises(ValueError, match="--variant does not combine with --structured-output"):
        args.func(args)
