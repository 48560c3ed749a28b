"""vLLM's structured_outputs_config, every field: parsing (unknown keys and bad values name the field), merging with
--structured-outputs-backend / --reasoning-parser, and each field's effect on the grammar and on generation."""

from __future__ import annotations

import json

import pytest

from pagemill import LLM, SamplingParams
from pagemill.config import StructuredOutputsConfig
from pagemill.engine.arg_utils import EngineArgs, structured_outputs_fields
from pagemill.sampling_params import StructuredOutputsParams
from pagemill.structured_output import grammar_spec, prepare
from tests.structured_output.conftest import assert_no_leak, chat_prompt

ALL_FIELDS = {"backend": "xgrammar", "disable_fallback": True, "disable_any_whitespace": True,
              "disable_additional_properties": True, "reasoning_parser": "deepseek_r1", "enable_in_reasoning": True}


def test_every_vllm_field_parses():
    assert structured_outputs_fields(ALL_FIELDS) == ALL_FIELDS
    assert structured_outputs_fields(json.dumps(ALL_FIELDS)) == ALL_FIELDS  # the CLI's JSON text
    assert structured_outputs_fields({"reasoning_parser": "", "reasoning_parser_plugin": ""}) == {
        "reasoning_parser": None}  # vLLM's defaults ("" = none)
    config = EngineArgs(structured_outputs_config=ALL_FIELDS).create_structured_outputs_config()
    assert {k: getattr(config, k) for k in ALL_FIELDS} == ALL_FIELDS
    # a config object (vLLM's StructuredOutputsConfig or ours) is read by its attributes
    assert structured_outputs_fields(StructuredOutputsConfig(disable_any_whitespace=True))["disable_any_whitespace"]


@pytest.mark.parametrize("value, field", [
    ({"disable_any_whitespace": True, "max_whitespace": 3}, "max_whitespace"),
    ({"backend": "outlines"}, "structured_outputs_config.backend"),
    ({"disable_fallback": "yes"}, "structured_outputs_config.disable_fallback"),
    ({"enable_in_reasoning": 1}, "structured_outputs_config.enable_in_reasoning"),
    ({"reasoning_parser": "nope"}, "structured_outputs_config.reasoning_parser"),
    ({"reasoning_parser_plugin": "/x.py"}, "structured_outputs_config.reasoning_parser_plugin"),
    ("{not json", "structured_outputs_config"),
])
def test_bad_fields_name_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        structured_outputs_fields(value)


def test_merge_with_flags():
    args = EngineArgs(structured_outputs_backend="guidance", reasoning_parser="qwen3",
                      structured_outputs_config={"disable_any_whitespace": True})
    config = args.create_structured_outputs_config()
    assert (config.backend, config.reasoning_parser, config.disable_any_whitespace) == ("guidance", "qwen3", True)
    with pytest.raises(ValueError, match="structured_outputs_config.backend"):
        EngineArgs(structured_outputs_backend="guidance",
                   structured_outputs_config={"backend": "xgrammar"}).create_structured_outputs_config()


def test_cli_flag():
    import argparse

    from pagemill.engine.arg_utils import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--structured-outputs-config", '{"disable_any_whitespace": true}'])
    assert ns.structured_outputs_config == {"disable_any_whitespace": True}
    with pytest.raises(SystemExit):
        parser.parse_args(["--structured-outputs-config", '{"disable_anything": true}'])


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "object", "properties": {
    "c": {"type": "boolean"}}}}, "required": ["a", "b"]}


def test_config_sets_request_defaults():
    params = StructuredOutputsParams(json=SCHEMA)
    plain = grammar_spec(params, StructuredOutputsConfig())
    assert plain.any_whitespace and not plain.disable_additional_properties
    strict = grammar_spec(params, StructuredOutputsConfig(disable_any_whitespace=True,
                                                          disable_additional_properties=True))
    assert not strict.any_whitespace and strict.disable_additional_properties


def test_disable_additional_properties_guidance_grammar():
    from pagemill.structured_output.backend_guidance import guidance_grammar

    spec = grammar_spec(StructuredOutputsParams(json=SCHEMA), StructuredOutputsConfig(
        disable_additional_properties=True))
    text = guidance_grammar(spec)
    assert text.count('"additionalProperties": false') + text.count('"additionalProperties":false') == 2
    assert "additionalProperties" not in guidance_grammar(grammar_spec(StructuredOutputsParams(json=SCHEMA),
                                                                       StructuredOutputsConfig()))


def test_disable_fallback():
    # xgrammar (auto's first choice) refuses whitespace_pattern; auto falls back to guidance unless told not to
    params = StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?")
    assert prepare(params, StructuredOutputsConfig())[1] == "guidance"
    with pytest.raises(ValueError, match="whitespace_pattern"):
        prepare(params, StructuredOutputsConfig(disable_fallback=True))
    with pytest.raises(ValueError, match="whitespace_pattern"):  # the request field, too
        prepare(StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?", disable_fallback=True),
                StructuredOutputsConfig())
    assert prepare(StructuredOutputsParams(json=SCHEMA), StructuredOutputsConfig(disable_fallback=True))[1] == \
        "xgrammar"


@pytest.fixture(scope="module")
def strict_llm(smol_path):
    llm = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024, max_num_seqs=8,
              structured_outputs_config={"disable_any_whitespace": True, "disable_additional_properties": True,
                                         "reasoning_parser": "deepseek_r1", "enable_in_reasoning": True,
                                         "disable_fallback": True})
    yield llm
    llm.llm_engine.shutdown() if hasattr(llm.llm_engine, "shutdown") else None


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_generation_is_compact_json(strict_llm, backend):
    config = strict_llm.llm_engine.config.structured_outputs_config
    assert config.reasoning_parser == "deepseek_r1"  # set through structured_outputs_config alone
    out = strict_llm.generate(chat_prompt("Give me a JSON object."), SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA, _backend=backend)),
        use_tqdm=False)[0].outputs[0].text
    value = json.loads(out)
    assert set(value) == {"a", "b"} and set(value["b"]) <= {"c"}
    assert out == json.dumps(value, separators=(",", ":"))  # no whitespace anywhere
    assert_no_leak(strict_llm)


def test_enable_in_reasoning(strict_llm, smol_path):
    # deepseek_r1 treats the reply as thinking until </think>: the grammar normally waits for it; with
    # enable_in_reasoning it applies from the first token.
    params = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = strict_llm.generate(chat_prompt("Is the sky blue?"), params, use_tqdm=False)[0].outputs[0].text
    assert out in ("yes", "no")
    with pytest.raises(ValueError, match="thinking_token_budget"):
        strict_llm.generate(chat_prompt("Is the sky blue?"), params.clone(thinking_token_budget=4), use_tqdm=False)
    assert_no_leak(strict_llm)
