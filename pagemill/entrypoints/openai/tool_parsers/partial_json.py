"""A JSON parser for text that may stop anywhere, and a serializer whose output only grows as the text does.

`parse_json(text, pos, final)` reads one JSON value left to right and stops at the end of the text or at the first
error; it never looks back, so the tree it builds for a prefix of a text is a prefix of the tree for the whole
text. `to_json(node)` writes a tree in one canonical form (`json.dumps` spacing, numbers as written) and leaves
out what may still change: closing brackets and quotes not yet seen, and numbers the text may still extend. So
the serialization of a prefix is a prefix of the serialization of the whole: streamed tool-call arguments are
that text's growth, and their concatenation is exactly the non-streamed arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum

WHITESPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("+-0123456789.eE")
_PLAIN_RUN = re.compile(r'[^"\\]+')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


class Status(Enum):
    """How reading a value ended."""

    DONE = "done"  # the value is complete
    MORE = "more"  # the text ended inside the value
    ERROR = "error"  # the text is not JSON at `end`


@dataclass
class JString:
    """A string; `closed` once its closing quote was read."""

    value: str = ""
    closed: bool = False


@dataclass
class JAtom:
    """A complete number, true, false or null, as written."""

    raw: str


@dataclass
class JArray:
    """An array; `closed` once its `]` was read."""

    items: list["Node"] = field(default_factory=list)
    closed: bool = False


@dataclass
class JMember:
    """One `"key": value` of an object, as far as it was read."""

    key: JString
    colon: bool = False
    value: "Node | None" = None


@dataclass
class JObject:
    """An object; `closed` once its `}` was read."""

    members: list[JMember] = field(default_factory=list)
    closed: bool = False

    def get(self, key: str) -> JMember | None:
        """The first member whose key is complete and equal to `key`."""
        return next((m for m in self.members if m.key.closed and m.key.value == key), None)


Node = JString | JAtom | JArray | JObject


@dataclass
class ParseResult:
    """The tree read (None if no value started), where reading stopped, and why."""

    node: Node | None
    end: int
    status: Status


def skip_ws(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def parse_json(text: str, pos: int = 0, final: bool = False) -> ParseResult:
    """Read one JSON value at `pos` (after whitespace). `final`: no more text will come, so a number at the end
    of the text is complete."""
    return _Reader(text, final).value(pos)


def to_json(node: Node | None) -> str:
    """The canonical JSON text of a (possibly unfinished) tree; an unfinished tree gives a prefix of its final text."""
    if node is None:
        return ""
    if isinstance(node, JString):
        s = json.dumps(node.value, ensure_ascii=False)
        return s if node.closed else s[:-1]
    if isinstance(node, JAtom):
        return node.raw
    if isinstance(node, JArray):
        return "[" + ", ".join(to_json(x) for x in node.items) + ("]" if node.closed else "")
    parts = []
    for m in node.members:
        part = to_json(m.key)
        if m.colon:
            part += ": " + to_json(m.value)
        parts.append(part)
    return "{" + ", ".join(parts) + ("}" if node.closed else "")


class _Reader:
    """Recursive descent over one text; every method returns (node, end, status)."""

    def __init__(self, text: str, final: bool) -> None:
        self.text, self.final, self.n = text, final, len(text)

    def value(self, pos: int) -> ParseResult:
        pos = skip_ws(self.text, pos)
        if pos == self.n:
            return ParseResult(None, pos, Status.MORE)
        c = self.text[pos]
        if c == "{":
            return self.object(pos)
        if c == "[":
            return self.array(pos)
        if c == '"':
            return self.string(pos)
        if c in "tfn":
            return self.literal(pos)
        if c == "-" or c.isdigit():
            return self.number(pos)
        return ParseResult(None, pos, Status.ERROR)

    def literal(self, pos: int) -> ParseResult:
        word = {"t": "true", "f": "false", "n": "null"}[self.text[pos]]
        seen = self.text[pos:pos + len(word)]
        if seen == word:
            return ParseResult(JAtom(word), pos + len(word), Status.DONE)
        if pos + len(seen) == self.n and word.startswith(seen):
            return ParseResult(None, pos, Status.MORE)
        return ParseResult(None, pos, Status.ERROR)

    def number(self, pos: int) -> ParseResult:
        end = pos
        while end < self.n and self.text[end] in _NUMBER_CHARS:
            end += 1
        if end == self.n and not self.final:
            return ParseResult(None, pos, Status.MORE)  # more digits may follow
        raw = self.text[pos:end]
        if _NUMBER.fullmatch(raw):
            return ParseResult(JAtom(raw), end, Status.DONE)
        return ParseResult(None, pos, Status.ERROR)

    def string(self, pos: int) -> ParseResult:
        text, chunks, i = self.text, [], pos + 1
        node = JString()
        while True:
            if i == self.n:
                node.value = "".join(chunks)
                return ParseResult(node, i, Status.MORE)
            c = text[i]
            if c == '"':
                node.value, node.closed = "".join(chunks), True
                return ParseResult(node, i + 1, Status.DONE)
            if c != "\\":
                run = _PLAIN_RUN.match(text, i)
                chunks.append(run.group())  # raw control characters are accepted (json.loads(strict=False))
                i = run.end()
                continue
            char, width = self._escape(i)
            if char is None:
                node.value = "".join(chunks)
                return ParseResult(node, i, Status.MORE if width == 0 else Status.ERROR)
            chunks.append(char)
            i += width

    def _escape(self, i: int) -> tuple[str | None, int]:
        """The character of the escape at `i` and its width; (None, 0) if the text ends inside it, (None, -1) if
        it is invalid. A surrogate pair is one escape; a lone surrogate reads as U+FFFD (it cannot be UTF-8)."""
        text = self.text
        if i + 1 == self.n:
            return None, 0
        e = text[i + 1]
        if e in _ESCAPES:
            return _ESCAPES[e], 2
        if e != "u":
            return None, -1
        code, width = self._hex4(i + 2)
        if code is None:
            return None, width
        if 0xDC00 <= code < 0xE000:
            return "\ufffd", 6
        if not 0xD800 <= code < 0xDC00:
            return chr(code), 6
        tail = text[i + 6:i + 8]
        if tail != "\\u"[:len(tail)]:
            return "\ufffd", 6
        if len(tail) < 2:
            return None, 0
        low, width = self._hex4(i + 8)
        if low is None:
            return (None, 0) if width == 0 else ("\ufffd", 6)
        if 0xDC00 <= low < 0xE000:
            return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12
        return "\ufffd", 6

    def _hex4(self, i: int) -> tuple[int | None, int]:
        digits = self.text[i:i + 4]
        if any(d not in _HEX for d in digits):
            return None, -1
        if len(digits) < 4:
            return None, 0
        return int(digits, 16), 4

    def array(self, pos: int) -> ParseResult:
        node, i = JArray(), skip_ws(self.text, pos + 1)
        if i == self.n:
            return ParseResult(node, i, Status.MORE)
        if self.text[i] == "]":
            node.closed = True
            return ParseResult(node, i + 1, Status.DONE)
        while True:
            item = self.value(i)
            if item.node is not None:
                node.items.append(item.node)
            if item.status is not Status.DONE:
                return ParseResult(node, item.end, item.status)
            i = skip_ws(self.text, item.end)
            if i == self.n:
                return ParseResult(node, i, Status.MORE)
            if self.text[i] == "]":
                node.closed = True
                return ParseResult(node, i + 1, Status.DONE)
            if self.text[i] != ",":
                return ParseResult(node, i, Status.ERROR)
            i += 1

    def object(self, pos: int) -> ParseResult:
        node, i = JObject(), skip_ws(self.text, pos + 1)
        if i < self.n and self.text[i] == "}":
            node.closed = True
            return ParseResult(node, i + 1, Status.DONE)
        while True:
            if i == self.n:
                return ParseResult(node, i, Status.MORE)
            if self.text[i] != '"':
                return ParseResult(node, i, Status.ERROR)
            key = self.string(i)
            member = JMember(key.node)  # type: ignore[arg-type]
            node.members.append(member)
            if key.status is not Status.DONE:
                return ParseResult(node, key.end, key.status)
            i = skip_ws(self.text, key.end)
            if i == self.n:
                return ParseResult(node, i, Status.MORE)
            if self.text[i] != ":":
                return ParseResult(node, i, Status.ERROR)
            member.colon = True
            value = self.value(i + 1)
            member.value = value.node
            if value.status is not Status.DONE:
                return ParseResult(node, value.end, value.status)
            i = skip_ws(self.text, value.end)
            if i == self.n:
                return ParseResult(node, i, Status.MORE)
            if self.text[i] == "}":
                node.closed = True
                return ParseResult(node, i + 1, Status.DONE)
            if self.text[i] != ",":
                return ParseResult(node, i, Status.ERROR)
            i = skip_ws(self.text, i + 1)
