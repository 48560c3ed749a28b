"""Speculative decoding options at the edges: the --speculative-config JSON flag (serve, generate, bench) and
the per-request `speculative_decoding` field of the OpenAI API."""

from __future__ import annotations

import argparse

import pydantic
import pytest

from pagemill.benchmarks.cli import build_parser as build_bench_parser
from pagemill.benchmarks.pagemill_backend import engine_kwargs
from pagemill.config import SpeculativeConfig
from pagemill.entrypoints.cli import build_parser
from pagemill.entrypoints.openai.cli_args import engine_args_from_namespace
from pagemill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagemill.entrypoints.openai.serving_engine import request_sampling_params

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"], ["chat", "hi"]])
def test_speculative_config_flag_reaches_the_engine_config(command):
    args = build_parser().parse_args([*command, "--speculative-config", NGRAM])
    engine_args = engine_args_from_namespace(args)
    assert engine_args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    spec = SpeculativeConfig.from_user(engine_args.speculative_config)
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 4)
    assert engine_args_from_namespace(build_parser().parse_args(command)).speculative_config is None


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram",', "speculative_config is not valid JSON"),
    ('["ngram"]', "speculative_config must be a JSON object"),
    ('{"method": "ngram", "num_spec_tokens": 4}', "speculative_config has unknown keys ['num_spec_tokens']"),
    ('{"method": "medusa"}', "speculative_config.method must be one of ngram, suffix, draft_model"),
    ('{"num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens must be in [1, 32]"),
])
@pytest.mark.parametrize("parser, command", [(build_parser, ["serve"]), (build_parser, ["generate", "x"]),
                                             (build_bench_parser, ["bench", "throughput"]),
                                             (build_bench_parser, ["bench", "latency"])])
def test_bad_speculative_config_is_a_parse_error_naming_it(capsys, value, message, parser, command):
    with pytest.raises(SystemExit) as e:
        parser().parse_args([*command, "--speculative-config", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculative-config:" in err and message in err


@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_bench_passes_speculative_config_to_llm(command):
    args = build_bench_parser().parse_args(["bench", command, "--speculative-config",
                                            '{"method": "suffix"}'])
    assert engine_kwargs(args, "m")["speculative_config"] == {"method": "suffix"}
    plain = build_bench_parser().parse_args(["bench", command])
    assert "speculative_config" not in engine_kwargs(plain, "m")


def test_bench_engine_arg_also_takes_speculative_config():
    args = build_bench_parser().parse_args(["bench", "throughput", "--engine-arg",
                                            'speculative_config={"method": "ngram", "prompt_lookup_max": 3}'])
    assert engine_kwargs(args, "m")["speculative_config"] == {"method": "ngram", "prompt_lookup_max": 3}


@pytest.mark.parametrize("make", [
    lambda **kw: CompletionRequest(prompt="hi", **kw),
    lambda **kw: ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw),
])
def test_request_speculative_decoding_maps_to_sampling_params(make):
    assert request_sampling_params(make(), 8, None, False).speculative_decoding is True  # default on
    off = request_sampling_params(make(speculative_decoding=False, temperature=0.0), 8, None, False)
    assert off.speculative_decoding is False and off.temperature == 0.0 and off.max_tokens == 8
    with pytest.raises(pydantic.ValidationError, match="speculative_decoding"):
        make(speculative_decoding="sometimes")


def test_namespace_without_speculative_flag_still_builds_engine_args():
    """Callers that build a Namespace by hand (no speculative_config attribute) keep working."""
    assert engine_args_from_namespace(argparse.Namespace(model=None)).speculative_config is None
