"""A request's output constraint in canonical, hashable form, and its backend choice and validation.

Validation is tokenizer-free (each library parses the schema / regex / grammar without the vocabulary), cached by
spec, and raises ValueError naming the field, so a bad request is rejected before it is queued.
"""

from __future__ import annotations

import json
from functools import lru_cache

from pagemill.config import STRUCTURED_OUTPUT_BACKENDS, StructuredOutputsConfig
from pagemill.sampling_params import StructuredOutputsParams
from pagemill.structured_output.grammar_spec import GrammarSpec

# JSON-schema keywords xgrammar accepts but does not enforce (vLLM routes these to llguidance under `auto`).
_XGRAMMAR_IGNORED_KEYWORDS = frozenset({
    "multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "patternProperties", "propertyNames",
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "unevaluatedItems", "minProperties",
    "maxProperties"})
def grammar_spec(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> GrammarSpec:
    """The canonical spec of a request's constraint (JSON schemas re-serialized, key order kept)."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structured_outputs.json: a JSON schema must be an object, got {type(schema).__name__}.")
        text = json.dumps(schema, ensure_ascii=False)  # key order kept: it is the order properties are generated in
    elif kind == "json_object":
        text = ""
    elif kind == "choice":
        text = json.dumps(list(params.choice), ensure_ascii=False)
    else:
        text = getattr(params, kind)
        if not isinstance(text, str) or not text:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string.")
    # the engine's structured_outputs_config sets the defaults a request can only tighten
    return GrammarSpec(kind, text,
                       any_whitespace=not (params.disable_any_whitespace or config.disable_any_whitespace),
                       max_whitespace=config.max_json_whitespace, whitespace_pattern=params.whitespace_pattern,
                       disable_additional_properties=(params.disable_additional_properties
                                                      or config.disable_additional_properties))


def is_lark(grammar: str) -> bool:
    """True when a grammar reads as Lark rather than EBNF/GBNF (no `::=` rule)."""
    return "::=" not in grammar


def xgrammar_ignores(spec: GrammarSpec) -> bool:
    """True when the spec uses something xgrammar cannot do exactly (Lark, or schema keywords it ignores)."""
    if spec.kind == "grammar":
        return is_lark(spec.text)
    if spec.kind != "json":
        return False

    def walk(node: object) -> bool:
        if isinstance(node, dict):
            return any(k in _XGRAMMAR_IGNORED_KEYWORDS for k in node) or any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False

    return walk(json.loads(spec.text))


def validate_for(backend: str, spec: GrammarSpec) -> None:
    """Raise ValueError (naming the field) unless `backend` can compile the spec."""
    if backend == "xgrammar":
        from pagemill.structured_output.backend_xgrammar import validate_xgrammar
        validate_xgrammar(spec)
    else:
        from pagemill.structured_output.backend_guidance import validate_guidance
        validate_guidance(spec)


@lru_cache(maxsize=1024)
def resolve_backend(configured: str, spec: GrammarSpec, disable_fallback: bool = False) -> str:
    """The backend that compiles this spec (validated): the configured one, or for `auto` xgrammar unless the spec
    needs llguidance. Raises ValueError naming the field when no backend accepts it. With `disable_fallback`,
    `auto` validates its first choice only and raises its error (vLLM's no-fallback)."""
    if configured not in STRUCTURED_OUTPUT_BACKENDS:
        raise ValueError(f"structured_outputs backend must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}, "
                         f"got {configured!r}.")
    if configured != "auto":
        validate_for(configured, spec)
        return configured
    if disable_fallback:
        first = "guidance" if xgrammar_ignores(spec) else "xgrammar"
        validate_for(first, spec)
        return first
    if not xgrammar_ignores(spec):
        try:
            validate_for("xgrammar", spec)
            return "xgrammar"
        except ValueError as xgr_error:
            if spec.kind == "structural_tag":
                raise
            try:
                validate_for("guidance", spec)
            except ValueError:
                raise xgr_error from None
            return "guidance"
    try:
        validate_for("guidance", spec)
        return "guidance"
    except ValueError as guidance_error:
        try:  # llguidance lacks it too: xgrammar, which accepts (and does not enforce) those keywords
            validate_for("xgrammar", spec)
        except ValueError:
            raise guidance_error from None
        return "xgrammar"


def prepare(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> tuple[GrammarSpec, str]:
    """(spec, backend) of a request's constraint; a backend the request names itself (`_backend`) wins."""
    spec = grammar_spec(params, config)
    backend = resolve_backend(params._backend or config.backend, spec,
                              params.disable_fallback or config.disable_fallback)
    return spec, backend
