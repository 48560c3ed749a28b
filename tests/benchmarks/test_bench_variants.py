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
