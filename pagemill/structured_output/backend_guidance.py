"""The llguidance backend: JSON schema, regex, choice and Lark (or GBNF) grammars."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import any_to_lark

from pagemill.structured_output.grammar_spec import GrammarSpec

_WS = r"[\x20\x0A\x0D\x09]"


def _json_options(spec: GrammarSpec) -> dict[str, Any]:
    if spec.whitespace_pattern is not None:
        return {"whitespace_pattern": spec.whitespace_pattern}
    if not spec.any_whitespace or spec.max_whitespace == 0:
        return {"whitespace_flexible": False}
    return {"whitespace_pattern": f"{_WS}{{1,{spec.max_whitespace}}}"}  # capped: no padding until max_tokens


def _no_additional_properties(node: Any) -> Any:
    """The schema with additionalProperties: false on every object that does not set it (vLLM's option)."""
    if isinstance(node, list):
        return [_no_additional_properties(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _no_additional_properties(v) for k, v in node.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def guidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar (its JSON form) of a spec; raises ValueError naming the field for what it lacks."""
    if spec.kind == "json":
        schema = json.loads(spec.text)
        if spec.disable_additional_properties:
            schema = _no_additional_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(spec))
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_json_options(spec))
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        choices = json.loads(spec.text)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if spec.kind == "grammar":
        try:
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.text))
        except Exception as e:
            raise spec.error(f"not a valid Lark or GBNF grammar: {e}") from None
    raise spec.error("not supported by the guidance backend (use xgrammar).")


def validate_guidance(spec: GrammarSpec) -> None:
    """Raise ValueError naming the field unless llguidance accepts the spec."""
    try:
        grammar = guidance_grammar(spec)
    except ValueError as e:
        if str(e).startswith(spec.field):
            raise
        raise spec.error(e) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise spec.error(error)


class GuidanceGrammar:
    """One request's llguidance matcher: follows its output tokens and fills its row of the token bitmask."""

    backend = "guidance"

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it."""
        return self.matcher.consume_token(token)

    def is_terminated(self) -> bool:
        """True once the grammar can take no more tokens (it ended, or only its stop token is left)."""
        return self.matcher.is_stopped()

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many of `tokens` (draft tokens) the grammar accepts in a row from here; the state is unchanged."""
        return self.matcher.validate_tokens(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        self.matcher.rollback(num_tokens)

    def forced_tokens(self, max_tokens: int) -> list[int]:
        """The tokens the grammar forces next (jump-forward; llguidance's fast-forward tokens), at most max_tokens."""
        return self.matcher.compute_ff_tokens()[:max_tokens]


class GuidanceBackend:
    """Builds llguidance matchers for one tokenizer and fills bitmasks with its parallel executor."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A matcher at the start of the grammar (copied for each request); raises ValueError if it is invalid."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, guidance_grammar(spec), log_level=0)
        if matcher.is_error():
            raise spec.error(matcher.get_error())
        return matcher

    def new_grammar(self, compiled: llguidance.LLMatcher) -> GuidanceGrammar:
        """A fresh matcher (a copy of the compiled one)."""
        return GuidanceGrammar(compiled.deep_copy())

    def fill_bitmask(self, grammars: list[GuidanceGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill bitmask[rows[i]] with grammars[i]'s allowed next tokens (in parallel, without the GIL)."""
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.dim() == 2
        batch, words = bitmask.shape  # (llguidance.torch.fill_next_token_bitmask_par, without its torch.compile import)
        self.executor.unsafe_compute_mask_ptr([(g.matcher, r) for g, r in zip(grammars, rows)], bitmask.data_ptr(),
                                              words * 4, batch)
