"""`bench throughput --structured-output`: the flag parses, the built-in request set is valid for the engine."""

from __future__ import annotations

import argparse

import pytest

from pagemill.benchmarks.structured_output import DATASET, STRUCTURED_OUTPUT_KINDS, is_valid
from pagemill.benchmarks.throughput import add_throughput_args
from pagemill.config import StructuredOutputsConfig
from pagemill.sampling_params import StructuredOutputsParams
from pagemill.structured_output import prepare


def test_flag_parses():
    parser = argparse.ArgumentParser()
    add_throughput_args(parser)
    assert parser.parse_args(["--structured-output", "json"]).structured_output == "json"
    assert parser.parse_args([]).structured_output is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--structured-output", "yaml"])


@pytest.mark.parametrize("kind", STRUCTURED_OUTPUT_KINDS)
def test_dataset_constraints_compile_on_both_backends(kind):
    for _, constraint in DATASET[kind]:
        for backend in ("xgrammar", "guidance"):
            prepare(StructuredOutputsParams(**constraint, _backend=backend), StructuredOutputsConfig())


def test_is_valid():
    assert is_valid("choice", {"choice": ["a", "b"]}, "a") and not is_valid("choice", {"choice": ["a"]}, "c")
    assert is_valid("regex", {"regex": r"\d+"}, "12") and not is_valid("regex", {"regex": r"\d+"}, "12a")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert is_valid("json", {"json": schema}, '{"n": 1}') and not is_valid("json", {"json": schema}, '{"m": 1}')
    assert not is_valid("json", {"json": schema}, '{"n": ')


@pytest.mark.slow
def test_throughput_run_reports_the_median_of_interleaved_iterations(tmp_path):
    from pagemill.benchmarks.cli import build_parser

    args = build_parser().parse_args([
        "bench", "throughput", "--structured-output", "regex", "--num-prompts", "4", "--random-output-len", "32",
        "--num-iters", "2", "--kv-cache-memory", "128MiB", "--max-model-len", "512"])
    payload = args.func(args)
    with_so, without = payload["results"]["constrained"], payload["results"]["unconstrained"]
    assert len(with_so["iterations"]) == len(without["iterations"]) == 2
    assert with_so["valid_outputs"] == 4
    runs = with_so["iterations"] + without["iterations"]
    assert all(r["total_output_tokens"] == with_so["total_output_tokens"] for r in runs)
    assert payload["ratio"]["mean_tpot"] == pytest.approx(with_so["mean_tpot_ms"] / without["mean_tpot_ms"])
