"""The tool-call parser interface, its registry, and the pieces the parsers share.

A parser maps the model's whole text so far to (content, tool calls). Its one rule: for a text and any
continuation of it, `parse(text, final=False)` gives a prefix of what `parse(longer, final=...)` gives, field by
field (the content a prefix of the content, the calls a prefix of the calls, each name equal, each argument string
a prefix). Streaming re-parses the whole text at every step and sends only the growth, so the streamed deltas of
any split of a text add up to exactly its non-streamed parse.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from pagemill.entrypoints.openai.tool_parsers.partial_json import (JArray, JObject, JString, Node, Status, parse_json,
                                                                  to_json)

_PARSERS: dict[str, type["ToolParser"]] = {}


@dataclass
class ParsedToolCall:
    """One function call: its name and its arguments as JSON text (a prefix while still being generated)."""

    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """The text of a reply split into content and tool calls."""

    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """Extracts tool calls from a model's text (see the module docstring for the prefix rule)."""

    name: ClassVar[str] = ""
    # The markers of this format are special tokens, so the reply must be detokenized with them kept.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict] | None = None) -> None:
        """`tools`: the request's tools as dicts ({"type": "function", "function": {...}}), for formats whose
        argument types come from the tools' schemas."""
        self.tools = tools or []

    def parameter_schema(self, function: str, parameter: str) -> dict | None:
        """The JSON schema of one parameter of one of the request's functions (None: not known)."""
        for tool in self.tools:
            fn = tool.get("function", tool)
            if fn.get("name") == function:
                props = (fn.get("parameters") or {}).get("properties") or {}
                schema = props.get(parameter)
                return schema if isinstance(schema, dict) else None
        return None

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Content and calls of `text`; `final` is True once the model has finished."""


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: make a parser selectable as `--tool-call-parser NAME`."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        cls.name = name
        _PARSERS[name] = cls
        return cls

    return register


def registered_parsers() -> dict[str, type[ToolParser]]:
    """Name -> parser class of every registered parser."""
    return dict(_PARSERS)


class Prefix(Enum):
    """How the text at a position compares with an expected literal."""

    YES = "yes"  # the literal is there
    MORE = "more"  # the text ends inside the literal
    NO = "no"


def match_literal(text: str, pos: int, literal: str) -> Prefix:
    """Whether `literal` starts at `pos`, may still start there (the text ends first), or does not."""
    seen = text[pos:pos + len(literal)]
    if seen == literal:
        return Prefix.YES
    return Prefix.MORE if len(seen) < len(literal) and literal.startswith(seen) else Prefix.NO


def without_marker_start(text: str, markers: Iterable[str]) -> str:
    """`text` less its longest ending that could be the start of a marker (held back while streaming)."""
    keep = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                keep = min(keep, len(text) - k)
                break
    return text[:keep]


def call_from_object(node: Node | None, argument_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """The call an object such as {"name": ..., "arguments": {...}} describes, once its name is complete.

    The first "name" member decides the name; the first member under one of `argument_keys` gives the arguments
    (an object, or a string holding the arguments' JSON text); a finished object without them has arguments {}.
    """
    if not isinstance(node, JObject):
        return None
    named = node.get("name")
    if named is None or not isinstance(named.value, JString) or not named.value.closed:
        return None
    arguments = ""
    member = next((m for m in node.members if m.key.closed and m.key.value in argument_keys and m.colon), None)
    if member is not None:
        value = member.value
        arguments = value.value if isinstance(value, JString) else to_json(value)
    elif node.closed:
        arguments = "{}"
    return ParsedToolCall(named.value.value, arguments)


def is_nameless(node: Node | None, finished: bool) -> bool:
    """True when a finished value can never be a call: not an object, or an object without a string name."""
    if node is None:
        return False
    if not isinstance(node, JObject):
        return True
    named = node.get("name")
    if named is not None and named.value is not None and not isinstance(named.value, JString):
        return True
    return finished and call_from_object(node, ()) is None


def calls_from_list(node: JArray, argument_keys: tuple[str, ...]) -> tuple[list[ParsedToolCall], bool]:
    """The calls of a JSON list of call objects, and whether the list holds something that is not a call."""
    calls: list[ParsedToolCall] = []
    for i, item in enumerate(node.items):
        call = call_from_object(item, argument_keys)
        finished = i < len(node.items) - 1 or node.closed or (isinstance(item, JObject) and item.closed)
        if call is None:
            return calls, is_nameless(item, finished)
        calls.append(call)
    return calls, False


def read_calls(text: str, pos: int, final: bool, argument_keys: tuple[str, ...],
               next_call: Callable[[str, int], int]) -> tuple[list[ParsedToolCall], bool]:
    """The calls of consecutive call objects, the first starting at `pos`; `next_call(text, end)` gives where the
    next object starts after one ending at `end` (-1: no more). Also whether something that is not a call stopped
    the sequence."""
    calls: list[ParsedToolCall] = []
    while True:
        result = parse_json(text, pos, final)
        call = call_from_object(result.node, argument_keys)
        if call is None:
            return calls, result.status is Status.ERROR or is_nameless(result.node, result.status is Status.DONE)
        calls.append(call)
        if result.status is not Status.DONE:
            return calls, False
        pos = next_call(text, result.end)
        if pos < 0:
            return calls, False


def resolve(text: str, content: str, calls: list[ParsedToolCall], failed: bool, final: bool) -> ParsedOutput:
    """The parse of a text whose tool-call part starts after `content`: the calls if there are any; else, once
    the part has failed or the model has finished, the whole text is content; else only `content` so far."""
    if calls:
        return ParsedOutput(content, calls)
    if failed or final:
        return ParsedOutput(text)
    return ParsedOutput(content)
