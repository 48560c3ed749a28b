"""Tool-call parsers by name (`--tool-call-parser`), and the parsers of forced tool choices."""

from __future__ import annotations

from pagemill.entrypoints.openai.tool_parsers import (deepseek_v3, granite, hermes, llama3_json, mistral,  # noqa: F401
                                                       openai, pythonic, qwen3_coder, xlam)  # (they register)
from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, ParsedToolCall, ToolParser,
                                                                register_tool_parser, registered_parsers)


def tool_parser_names() -> list[str]:
    """The names `--tool-call-parser` accepts."""
    return sorted(registered_parsers())


def get_tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """A parser by name (given the request's tools); ValueError naming tool_call_parser for an unknown one."""
    parsers = registered_parsers()
    if name not in parsers:
        raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(parsers))}, got {name!r}.")
    return parsers[name](tools)


__all__ = ["ParsedOutput", "ParsedToolCall", "ToolParser", "get_tool_parser", "register_tool_parser",
           "tool_parser_names"]
