"""Length distributions and exact-length prompts of the benchmark datasets."""

import argparse
import json

import numpy as np
import pytest

from pagemill.benchmarks import datasets as D
from pagemill.benchmarks.lengths import (ALPACA_INPUT, ALPACA_OUTPUT, SHAREGPT_INPUT,
                                         SHAREGPT_OUTPUT, LogNormalSpec, clipped_lognormal_mean,
                                         sample_lognormal_lengths, sample_uniform_lengths, solve_mu)
from pagemill.benchmarks.prompts import PromptBuilder


@pytest.fixture(scope="module")
def builder(tokenizer):
    return PromptBuilder(tokenizer)


@pytest.mark.parametrize("spec", [SHAREGPT_INPUT, SHAREGPT_OUTPUT, ALPACA_INPUT, ALPACA_OUTPUT])
def test_lognormal_lengths_hit_paper_means(spec):
    assert clipped_lognormal_mean(solve_mu(spec), spec.sigma, spec.low, spec.high) == \
        pytest.approx(spec.mean, rel=1e-6)
    lens = np.array(sample_lognormal_lengths(spec, 200_000, np.random.default_rng(1)))
    assert lens.mean() == pytest.approx(spec.mean, rel=0.02)
    assert lens.min() >= spec.low and lens.max() <= spec.high
    assert lens.std() > 0.5 * spec.mean  # heavy-tailed, not a constant


def test_paper_trace_means():
    assert (SHAREGPT_INPUT.mean, SHAREGPT_OUTPUT.mean) == (161.31, 337.99)
    assert (ALPACA_INPUT.mean, ALPACA_OUTPUT.mean) == (19.31, 58.45)


def test_solve_mu_rejects_impossible_mean():
    with pytest.raises(ValueError):
        solve_mu(LogNormalSpec(mean=2.0, sigma=1.0, low=4, high=100))


def test_uniform_lengths_range():
    lens = sample_uniform_lengths(100, 0.25, 5000, np.random.default_rng(0))
    assert min(lens) == 75 and max(lens) == 125
    assert np.mean(lens) == pytest.approx(100, rel=0.02)
    assert sample_uniform_lengths(64, 0.0, 3, np.random.default_rng(0)) == [64, 64, 64]
    with pytest.raises(ValueError):
        sample_uniform_lengths(64, 1.0, 3, np.random.default_rng(0))


def test_builder_exact_lengths_and_roundtrip(builder, tokenizer):
    rng = np.random.default_rng(0)
    roundtrip = 0
    for n in [1, 2, 7, 64, 300, 1500]:  # 1500 > corpus length: the slice wraps around
        text, ids = builder.build(n, rng)
        assert len(ids) == n
        roundtrip += tokenizer.encode(text, add_special_tokens=False) == ids
    assert roundtrip >= 5


def test_random_dataset_exact_lengths_with_shared_prefix(builder, tokenizer):
    samples = D.random_dataset(builder, 30, input_len=40, output_len=20, range_ratio=0.5,
                               prefix_len=16, seed=3)
    assert len(samples) == 30
    prefixes = {tuple(s.prompt_token_ids[:16]) for s in samples}
    assert len(prefixes) == 1
    for s in samples:
        assert s.prompt_len == len(s.prompt_token_ids)
        assert 16 + 20 <= s.prompt_len <= 16 + 60
        assert 10 <= s.expected_output_len <= 30
    assert len({s.prompt_len for s in samples}) > 5
    same_text = sum(tokenizer.encode(s.prompt, add_special_tokens=False) == s.prompt_token_ids
                    for s in samples)
    assert same_text >= 28


def test_random_dataset_fixed_lengths_and_seed(builder):
    a = D.random_dataset(builder, 10, 64, 32, seed=7)
    b = D.random_dataset(builder, 10, 64, 32, seed=7)
    c = D.random_dataset(builder, 10, 64, 32, seed=8)
    assert a == b and a != c
    assert {s.prompt_len for s in a} == {64} and {s.expected_output_len for s in a} == {32}


@pytest.mark.parametrize("make,in_mean,out_mean", [
    (D.sharegpt_dataset, 161.31, 337.99),
    (D.alpaca_dataset, 19.31, 58.45),
])
def test_synthetic_traces_means(builder, make, in_mean, out_mean):
    samples = make(builder, 400, seed=0)
    assert all(s.prompt_len == len(s.prompt_token_ids) for s in samples)
    assert np.mean([s.prompt_len for s in samples]) == pytest.approx(in_mean, rel=0.15)
    assert np.mean([s.expected_output_len for s in samples]) == pytest.approx(out_mean, rel=0.15)
    fixed = make(builder, 5, output_len=11, seed=0)
    assert {s.expected_output_len for s in fixed} == {11}


def test_prefix_dataset_groups(builder):
    samples = D.prefix_dataset(builder, 12, prefix_len=50, suffix_len=10, num_prefixes=3,
                               output_len=8, seed=0)
    groups: dict[tuple, int] = {}
    for s in samples:
        assert s.prompt_len == 60 and s.expected_output_len == 8
        groups[tuple(s.prompt_token_ids[:50])] = groups.get(tuple(s.prompt_token_ids[:50]), 0) + 1
    assert sorted(groups.values()) == [4, 4, 4]
    assert len({tuple(s.prompt_token_ids) for s in samples}) == 12


def test_custom_dataset(builder, tokenizer, tmp_path):
    path = tmp_path / "reqs.jsonl"
    path.write_text(json.dumps({"prompt": "Hello there, how are you?", "output_len": 5}) + "\n\n"
                    + json.dumps({"prompt": "Tell me a story."}) + "\n")
    samples = D.custom_dataset(builder, str(path), 3, default_output_len=42)
    assert [s.expected_output_len for s in samples] == [5, 42, 5]
    assert samples[0].prompt_token_ids == tokenizer.encode("Hello there, how are you?",
                                                           add_special_tokens=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        D.custom_dataset(builder, str(bad), 1, 4)


def test_get_samples_dispatch(tokenizer):
    parser = argparse.ArgumentParser()
    D.add_dataset_args(parser)
    args = parser.parse_args(["--dataset-name", "prefix_repetition", "--num-prompts", "4",
                              "--prefix-repetition-prefix-len", "8",
                              "--prefix-repetition-suffix-len", "4",
                              "--prefix-repetition-num-prefixes", "2"])
    samples = D.get_samples(args, tokenizer)
    assert [s.prompt_len for s in samples] == [12] * 4
    args = parser.parse_args(["--dataset-name", "custom"])
    with pytest.raises(ValueError, match="dataset-path"):
        D.get_samples(args, tokenizer)
