"""Tool-call parsers by name (`--tool-call-parser`), and the parsers of forced tool choices."""

from __future__ import annotations

from pagemill.entrypoints.openai.tool_parsers import hermes, llama3_json, xlam  # noqa: F401  (they register)
from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, ParsedToolCall, ToolParser,
                                                                register_tool_parser, registered_parsers)


def tool_parser_names() -> list[str]:
    """The names `--tool-call-parser` accepts."""
    return sorted(registered_parsers())


def get_tool_parser(name: str) -> ToolParser:
    """A parser by name; ValueError naming tool_call_parser for an unknown one."""
    parsers = registered_parsers()
    if name not in parsers:
        raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(parsers))}, got {name!r}.")
    return parsers[name]()


__all__ = ["ParsedOutput", "ParsedToolCall", "ToolParser", "get_tool_parser", "register_tool_parser",
           "tool_parser_names"]
