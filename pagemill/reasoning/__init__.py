"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's names): split a reasoning model's reply into its thinking
(`reasoning`, formerly `reasoning_content`) and its answer (`content`), whole or streamed; and the token-level
gate the engine core uses to start a structured-output grammar after the thinking and to enforce a thinking
budget (`thinking_token_budget`)."""

from __future__ import annotations

from pagemill.reasoning import granite, think_tags  # noqa: F401  (they register)
from pagemill.reasoning.abs_reasoning_parsers import (ReasoningDelta, ReasoningParser, ReasoningStreamer,
                                                      get_reasoning_parser, reasoning_parser_names,
                                                      register_reasoning_parser)
from pagemill.reasoning.token_gate import ReasoningGate, ReasoningTokens

__all__ = ["ReasoningDelta", "ReasoningGate", "ReasoningParser", "ReasoningStreamer", "ReasoningTokens",
           "get_reasoning_parser", "reasoning_parser_names", "register_reasoning_parser"]
