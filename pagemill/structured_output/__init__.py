"""Structured output (guided decoding): grammar backends (xgrammar, llguidance), validation, per-step bitmasks."""

from pagemill.structured_output.spec import GrammarSpec, grammar_spec, prepare, resolve_backend

__all__ = ["GrammarSpec", "grammar_spec", "prepare", "resolve_backend"]
