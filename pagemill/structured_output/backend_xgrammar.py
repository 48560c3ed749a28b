"""The xgrammar backend: JSON schema, regex, choice, EBNF/GBNF grammars and structural tags."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import torch
import xgrammar as xgr

from pagemill.structured_output.grammar_spec import GrammarSpec


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _json_kwargs(spec: GrammarSpec) -> dict[str, Any]:
    # any_whitespace with a cap: JSON cannot be padded with whitespace until max_tokens.
    if not spec.any_whitespace or spec.max_whitespace == 0:
        return dict(any_whitespace=False, separators=(",", ":"))  # compact (xgrammar's default keeps ", " / ": ")
    return dict(any_whitespace=True, max_whitespace_cnt=spec.max_whitespace)


def _grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The tokenizer-free xgrammar Grammar of a spec (raises the library's errors)."""
    if spec.kind == "json":
        return xgr.Grammar.from_json_schema(spec.text, strict_mode=True, **_json_kwargs(spec))
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **_json_kwargs(spec))
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.text)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_ebnf(json.loads(spec.text)))
    if spec.kind == "grammar":
        return xgr.Grammar.from_ebnf(spec.text)
    if spec.kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(spec.text)
    raise ValueError(f"{spec.field}: unknown constraint kind.")


def validate_xgrammar(spec: GrammarSpec) -> None:
    """Raise ValueError naming the field unless xgrammar accepts the spec."""
    if spec.whitespace_pattern is not None:
        raise spec.error("whitespace_pattern is not supported by the xgrammar backend (use guidance).")
    if spec.kind == "grammar" and "::=" not in spec.text:
        raise spec.error("the xgrammar backend takes EBNF/GBNF grammars (`rule ::= ...`); Lark needs guidance.")
    try:
        _grammar(spec)
    except ValueError:
        raise
    except Exception as e:  # RuntimeError, InvalidJSONError, InvalidStructuralTagError, ...
        raise spec.error(e) from None


class XgrammarGrammar:
    """One request's matcher: follows its output tokens and fills its row of the token bitmask."""

    backend = "xgrammar"

    def __init__(self, matcher: xgr.GrammarMatcher, encode: Callable[[str], list[int]]) -> None:
        self.matcher = matcher
        self._encode = encode

    def accept_token(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (the state is then unchanged)."""
        return self.matcher.accept_token(token)

    def is_terminated(self) -> bool:
        """True once the grammar has ended (its stop token accepted)."""
        return self.matcher.is_terminated()

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many of `tokens` (draft tokens) the grammar accepts in a row from here; the state is unchanged."""
        n = 0
        for t in tokens:
            if not self.matcher.accept_token(t):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        self.matcher.rollback(num_tokens)

    def forced_tokens(self, max_tokens: int) -> list[int]:
        """Tokens of the text the grammar forces next (jump-forward), as the tokenizer splits it, cut where the
        grammar would not take them; [] when the next token is not forced."""
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        tokens = self._encode(text)[:max_tokens]
        return tokens[:self.validate_tokens(tokens)]


class XgrammarBackend:
    """Compiles specs against one tokenizer (xgrammar's own compiler, threads and cache) and fills bitmasks."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        stop = [eos_token_id] if eos_token_id is not None else None
        # vocab_size is the model's (it may exceed the tokenizer's: the extra ids are never allowed).
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)
        self._encode = functools.partial(tokenizer.encode, add_special_tokens=False)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar (tokenizer-specific token masks precomputed)."""
        return self.compiler.compile_grammar(_grammar(spec))

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        """A fresh matcher at the start of the grammar."""
        return XgrammarGrammar(xgr.GrammarMatcher(compiled), self._encode)

    def fill_bitmask(self, grammars: list[XgrammarGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill bitmask[rows[i]] with grammars[i]'s allowed next tokens (one batched, multi-threaded call)."""
        self.batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)
