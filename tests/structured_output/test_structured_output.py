"""Structured output end to end on SmolLM2: every output of the schema corpus validates, regex / choice / grammar
outputs match, both backends and auto, mixed batches, n > 1, stop strings / logprobs / penalties, and bad
constraints are rejected before they are queued."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagemill import SamplingParams
from pagemill.sampling_params import StructuredOutputsParams
from tests.structured_output.conftest import assert_no_leak, chat_prompt
from tests.structured_output.schemas import GUIDANCE_ONLY, SCHEMAS

BACKENDS = ["xgrammar", "guidance"]
MAX_TOKENS = 256  # generous: every corpus schema is bounded, so its output ends well before


def _json_prompt(name: str, schema: dict) -> str:
    return chat_prompt(f"Give an example {name.replace('_', ' ')} as JSON matching this schema: {json.dumps(schema)}")


def _check_json(out, schema: dict, name: str) -> None:
    c = out.outputs[0] if hasattr(out, "outputs") else out
    assert c.finish_reason == "stop", f"{name}: truncated ({c.finish_reason}): {c.text!r}"
    value = json.loads(c.text)
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


def _run_corpus(llm, corpus, backend: str | None, **sampling) -> None:
    params = [SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=schema,
                                                                                               _backend=backend),
                             **({"seed": k} if sampling.get("temperature") else {}), **sampling)
              for k, (_, schema) in enumerate(corpus)]
    outs = llm.generate([_json_prompt(n, s) for n, s in corpus], params, use_tqdm=False)
    failures = []
    for (name, schema), out in zip(corpus, outs):
        try:
            _check_json(out, schema, name)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{name}: {str(e)[:300]}")
    assert not failures, "\n".join(failures)
    assert_no_leak(llm)


def test_corpus_has_50_schemas():
    assert len(SCHEMAS) >= 50 and len({n for n, _ in SCHEMAS}) == len(SCHEMAS)
    for _, schema in SCHEMAS + GUIDANCE_ONLY:
        jsonschema.Draft202012Validator.check_schema(schema)


def test_json_schema_corpus_greedy(so_llm):
    """auto: every schema's greedy output parses, validates and ends with "stop" (bounded whitespace)."""
    _run_corpus(so_llm, SCHEMAS + GUIDANCE_ONLY, None, temperature=0.0)


@pytest.mark.slow
def test_json_schema_corpus_sampled(so_llm):
    _run_corpus(so_llm, SCHEMAS + GUIDANCE_ONLY, None, temperature=0.8, top_p=0.95)


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schemas_per_backend(so_llm, backend):
    """Each backend, greedy and seeded sampling, on a slice of the corpus."""
    corpus = SCHEMAS[::5]
    _run_corpus(so_llm, corpus, backend, temperature=0.0)
    _run_corpus(so_llm, corpus, backend, temperature=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schema_corpus_full_per_backend(so_llm, backend):
    _run_corpus(so_llm, SCHEMAS, backend, temperature=0.0)


def test_auto_picks_llguidance_for_what_xgrammar_ignores(so_llm):
    from pagemill.config import StructuredOutputsConfig
    from pagemill.structured_output import prepare

    for _, schema in GUIDANCE_ONLY:
        assert prepare(StructuredOutputsParams(json=schema), StructuredOutputsConfig())[1] == "guidance"
    assert prepare(StructuredOutputsParams(json=SCHEMAS[0][1]), StructuredOutputsConfig())[1] == "xgrammar"
    assert prepare(StructuredOutputsParams(grammar='start: "a"'), StructuredOutputsConfig())[1] == "guidance"


@pytest.mark.parametrize("backend", [None, *BACKENDS])
def test_json_object(so_llm, backend):
    out = so_llm.generate(chat_prompt("Give a JSON object with a name and an age."), SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json_object=True,
                                                                                         _backend=backend)),
        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


REGEXES = [r"\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,10}",
           r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(true|false)"]


@pytest.mark.parametrize("backend", [None, *BACKENDS])
def test_regex(so_llm, backend):
    prompts = [chat_prompt("Write a phone number."), chat_prompt("Name a pet."), chat_prompt("Name a person."),
               chat_prompt("Give a date."), chat_prompt("Is water wet?")]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=7, max_tokens=64,
                                 structured_outputs=StructuredOutputsParams(regex=r, _backend=backend))
                  for r in REGEXES]
        for r, out in zip(REGEXES, so_llm.generate(prompts, params, use_tqdm=False)):
            c = out.outputs[0]
            assert c.finish_reason == "stop" and re.fullmatch(r, c.text), (r, c.text)


@pytest.mark.parametrize("backend", [None, *BACKENDS])
def test_choice(so_llm, backend):
    choices = ["positive", "negative", "neutral \"quoted\"", "héllo"]
    prompts = [chat_prompt(f"Sentiment of: {t}") for t in ("I love it", "I hate it", "It is a table", "Bonjour")]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=32,
                                structured_outputs=StructuredOutputsParams(choice=choices, _backend=backend))
        for out in so_llm.generate(prompts, params, use_tqdm=False):
            assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"


ARITH_EBNF = r"""root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}"""

ARITH_LARK = r"""start: expr
expr: term (("+" | "-") term)~0..3
term: factor (("*" | "/") factor)~0..2
factor: NUM | "(" expr ")"
NUM: /[1-9][0-9]{0,2}/"""


def parse_arith(text: str) -> int:
    """A recursive-descent parser of the arithmetic grammar (no whitespace); returns the number of numbers."""
    pos = 0

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def expr() -> int:
        nonlocal pos
        n = term()
        while peek() in ("+", "-") and peek():
            pos += 1
            n += term()
        return n

    def term() -> int:
        nonlocal pos
        n = factor()
        while peek() in ("*", "/") and peek():
            pos += 1
            n += factor()
        return n

    def factor() -> int:
        nonlocal pos
        if peek() == "(":
            pos += 1
            n = expr()
            assert peek() == ")", text
            pos += 1
            return n
        m = re.match(r"[1-9][0-9]{0,2}", text[pos:])
        assert m, f"number expected at {pos} in {text!r}"
        pos += m.end()
        return 1

    count = expr()
    assert pos == len(text), f"trailing text in {text!r}"
    return count


@pytest.mark.parametrize("backend,grammar", [(None, ARITH_EBNF), ("xgrammar", ARITH_EBNF), ("guidance", ARITH_LARK),
                                             ("guidance", ARITH_EBNF)])
def test_grammar_arithmetic(so_llm, backend, grammar):
    prompts = [chat_prompt("Write an arithmetic expression."), chat_prompt("Compute 12 times 7 plus 3."),
               chat_prompt("What is (4+5)*6?")]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=11, max_tokens=96,
                                structured_outputs=StructuredOutputsParams(grammar=grammar, _backend=backend))
        for out in so_llm.generate(prompts, params, use_tqdm=False):
            c = out.outputs[0]
            assert c.finish_reason == "stop", c.text
            assert parse_arith(c.text) >= 1
            compile(c.text, "<expr>", "eval")  # Python's parser agrees


def test_mixed_batch_leaves_unconstrained_rows_alone(so_llm):
    """Greedy unconstrained requests produce the same tokens with constrained requests in their batch."""
    plain = [chat_prompt("Tell me about the sea."), "The capital of France is", "def fibonacci(n):"]
    plain_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in so_llm.generate(plain, plain_params, use_tqdm=False)]
    name, schema = SCHEMAS[0]
    constrained = SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    prompts = [_json_prompt(name, schema), plain[0], chat_prompt("a or b?"), plain[1], plain[2]]
    outs = so_llm.generate(prompts, [constrained, plain_params, choice, plain_params, plain_params], use_tqdm=False)
    assert [outs[i].outputs[0].token_ids for i in (1, 3, 4)] == alone
    _check_json(outs[0], schema, name)
    assert outs[2].outputs[0].text in ("a", "b")
    assert_no_leak(so_llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_sampling_siblings_each_valid(so_llm, backend):
    name, schema = SCHEMAS[41]  # recipe: several fields, arrays
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(json=schema, _backend=backend))
    out = so_llm.generate(_json_prompt(name, schema), params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        _check_json(c, schema, name)
    assert_no_leak(so_llm)


def test_with_logprobs_penalties_min_tokens_and_stop_strings(so_llm):
    name, schema = SCHEMAS[1]  # book
    so = StructuredOutputsParams(json=schema)
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=MAX_TOKENS, logprobs=3, presence_penalty=0.5,
                            frequency_penalty=0.3, repetition_penalty=1.1, min_tokens=5, structured_outputs=so)
    c = so_llm.generate(_json_prompt(name, schema), params, use_tqdm=False)[0].outputs[0]
    _check_json(c, schema, name)
    assert len(c.logprobs) == len(c.token_ids)
    assert all(lp[t].logprob > float("-inf") for t, lp in zip(c.token_ids, c.logprobs))
    # min_tokens longer than the grammar: the grammar's end wins (EOS is not masked twice into an empty row).
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    c = so_llm.generate(chat_prompt("yes or no?"), params, use_tqdm=False)[0].outputs[0]
    assert c.text in ("yes", "no") and c.finish_reason == "stop"
    # A stop string inside the constrained output ends the request early; the engine cleans up.
    stop = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=['"author"'], structured_outputs=so)
    c = so_llm.generate(_json_prompt(name, schema), stop, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == '"author"' and '"author"' not in c.text
    assert_no_leak(so_llm)


BAD = [
    (dict(json={"type": "object", "properties": 5}), "structured_outputs.json"),
    (dict(json='{"type": "object",'), "structured_outputs.json"),
    (dict(json={"type": "strin"}), "structured_outputs.json"),
    (dict(json={"$ref": "#/$defs/missing"}), "structured_outputs.json"),
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(regex="[z-a]"), "structured_outputs.regex"),
    (dict(grammar="root ::= ( \"a\""), "structured_outputs.grammar"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (dict(json_object=True, _backend="outlines"), "backend"),
]


@pytest.mark.parametrize("backend", [None, *BACKENDS])
def test_invalid_constraints_rejected_before_queueing(so_llm, backend):
    for kwargs, field in BAD:
        kwargs = {"_backend": backend, **kwargs}
        with pytest.raises(ValueError, match=re.escape(field)):
            so_llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**kwargs)),
                            use_tqdm=False)
        assert_no_leak(so_llm)
    # The engine core rejects them too (a client that skips the Processor), before anything is queued.
    core = so_llm.llm_engine.engine_core
    from pagemill.messages import EngineCoreRequest

    with pytest.raises(ValueError, match="structured_outputs.regex"):
        core.add_request(EngineCoreRequest("bad", [1, 2, 3], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="(", _backend=backend)), 2, 0.0))
    assert "bad" not in core.scheduler.requests
    # ... and keeps working.
    out = so_llm.generate(chat_prompt("yes or no?"), SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")
    assert_no_leak(so_llm)


def test_unknown_backend_option(smol_path):
    from pagemill import LLM

    with pytest.raises(ValueError, match="structured_outputs_config.backend"):
        LLM(smol_path, structured_outputs_config={"backend": "outlines"})
    with pytest.raises(ValueError, match="structured_outputs_config"):
        LLM(smol_path, structured_outputs_config={"backend": "auto", "reasoning_parser": "x"})


def test_profiler_reports_grammar_time(so_llm):
    core = so_llm.llm_engine.engine_core
    core.profiler.enabled = core.executor.model_runner.profiler.enabled = True
    try:
        core.profiler.reset()
        so_llm.generate(chat_prompt("yes or no?"), SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
            use_tqdm=False)
        report = core.profiler.report()
    finally:
        core.profiler.enabled = core.executor.model_runner.profiler.enabled = False
    assert report["grammar_ms"] > 0 and report["grammar_fill_ms"] > 0
