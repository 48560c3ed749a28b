"""Pythonic calls (Llama 3.2 / 4, ToolACE, ...): the reply is a Python list of calls with keyword arguments,
`[get_weather(city="Paris", unit='celsius'), get_time()]`, optionally between `<|python_start|>` and
`<|python_end|>`. Argument values are Python literals (strings, numbers, True / False / None, lists, tuples,
dicts), sent as JSON. A reply that is not such a list is content."""

from __future__ import annotations

import ast
import json
import re

from pagemill.entrypoints.openai.tool_parsers.abstract import (ParsedOutput, ParsedToolCall, Prefix, ToolParser,
                                                                match_literal, register_tool_parser, resolve)
from pagemill.entrypoints.openai.tool_parsers.partial_json import (JArray, JAtom, JMember, JObject, JString,
                                                                  ParseResult, Status, skip_ws, to_json)

PYTHON_START = "<|python_start|>"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_NUMBER = re.compile(r"-?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("+-0123456789._eE")
_WORDS = {"True": "true", "False": "false", "None": "null"}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "0": "\0", "a": "\a", "b": "\b",
            "f": "\f", "v": "\v", "\n": ""}
_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """Calls only when the reply starts with `[` (after whitespace and `<|python_start|>`, which is read whether
    or not special tokens are skipped)."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pos = skip_ws(text, 0)
        tag = match_literal(text, pos, PYTHON_START)
        if tag is Prefix.MORE and pos < len(text):
            return resolve(text, "", [], False, final)
        if tag is Prefix.YES:
            pos = skip_ws(text, pos + len(PYTHON_START))
        if pos == len(text):
            return resolve(text, "", [], False, final)
        if text[pos] != "[":
            return ParsedOutput(text)
        calls, status = _Reader(text, final).calls(pos)
        return resolve(text, "", calls, status is Status.ERROR, final)


class _Reader:
    """Reads the call list left to right, stopping at the end of the text or at the first error; the trees of
    its arguments grow the way partial_json's do, so their JSON text only grows."""

    def __init__(self, text: str, final: bool) -> None:
        self.text, self.final, self.n = text, final, len(text)

    def calls(self, pos: int) -> tuple[list[ParsedToolCall], Status]:
        calls: list[ParsedToolCall] = []
        i = skip_ws(self.text, pos + 1)
        while True:
            if i == self.n:
                return calls, Status.MORE
            if self.text[i] == "]" and not calls:
                return calls, Status.DONE
            name = _DOTTED.match(self.text, i)
            if name is None:
                return calls, Status.ERROR
            i = skip_ws(self.text, name.end())
            if i == self.n:
                return calls, Status.MORE
            if self.text[i] != "(":
                return calls, Status.ERROR
            args = JObject()
            status, i = self.arguments(args, i + 1)
            if args.members or args.closed:  # a call once its first keyword (or its end) shows it is one
                calls.append(ParsedToolCall(name.group(), to_json(args)))
            if status is not Status.DONE:
                return calls, status
            i = skip_ws(self.text, i)
            if i == self.n:
                return calls, Status.MORE
            if self.text[i] == "]":
                return calls, Status.DONE
            if self.text[i] != ",":
                return calls, Status.ERROR
            i = skip_ws(self.text, i + 1)

    def arguments(self, node: JObject, i: int) -> tuple[Status, int]:
        """The `key=value, ...)` of one call into `node`."""
        while True:
            i = skip_ws(self.text, i)
            if i == self.n:
                return Status.MORE, i
            if self.text[i] == ")":
                node.closed = True
                return Status.DONE, i + 1
            key = _IDENT.match(self.text, i)
            if key is None:
                return Status.ERROR, i
            j = skip_ws(self.text, key.end())
            if j == self.n:
                return Status.MORE, j
            if self.text[j] != "=":
                return Status.ERROR, j
            member = JMember(JString(key.group(), True), True)
            node.members.append(member)
            value = self.value(j + 1)
            member.value = value.node
            if value.status is not Status.DONE:
                return value.status, value.end
            i = skip_ws(self.text, value.end)
            if i == self.n:
                return Status.MORE, i
            if self.text[i] == ",":
                i += 1
            elif self.text[i] != ")":
                return Status.ERROR, i

    def value(self, pos: int) -> ParseResult:
        pos = skip_ws(self.text, pos)
        if pos == self.n:
            return ParseResult(None, pos, Status.MORE)
        c = self.text[pos]
        if c in "'\"":
            return self.string(pos)
        if c in "[(":
            return self.sequence(pos, "]" if c == "[" else ")")
        if c == "{":
            return self.dict(pos)
        if c in "-." or c.isdigit():
            return self.number(pos)
        if c.isalpha():
            return self.word(pos)
        return ParseResult(None, pos, Status.ERROR)

    def word(self, pos: int) -> ParseResult:
        ident = _IDENT.match(self.text, pos)
        end = ident.end() if ident else pos
        raw = self.text[pos:end]
        if end == self.n and not self.final and any(w.startswith(raw) for w in _WORDS):
            return ParseResult(None, pos, Status.MORE)
        if raw in _WORDS:
            return ParseResult(JAtom(_WORDS[raw]), end, Status.DONE)
        return ParseResult(None, pos, Status.ERROR)

    def number(self, pos: int) -> ParseResult:
        end = pos
        while end < self.n and self.text[end] in _NUMBER_CHARS:
            end += 1
        if end == self.n and not self.final:
            return ParseResult(None, pos, Status.MORE)
        raw = self.text[pos:end]
        if not _NUMBER.fullmatch(raw):
            return ParseResult(None, pos, Status.ERROR)
        value = ast.literal_eval(raw.lstrip("-"))
        return ParseResult(JAtom(json.dumps(-value if raw.startswith("-") else value)), end, Status.DONE)

    def string(self, pos: int) -> ParseResult:
        text, quote = self.text, self.text[pos]
        node, chunks, i = JString(), [], pos + 1
        while True:
            if i == self.n:
                node.value = "".join(chunks)
                return ParseResult(node, i, Status.MORE)
            c = text[i]
            if c == quote:
                node.value, node.closed = "".join(chunks), True
                return ParseResult(node, i + 1, Status.DONE)
            if c != "\\":
                chunks.append(c)
                i += 1
                continue
            if i + 1 == self.n:
                node.value = "".join(chunks)
                return ParseResult(node, i, Status.MORE)
            e = text[i + 1]
            if e in _HEX_WIDTH:
                digits = text[i + 2:i + 2 + _HEX_WIDTH[e]]
                if not all(d in "0123456789abcdefABCDEF" for d in digits):
                    return ParseResult(None, pos, Status.ERROR)
                if len(digits) < _HEX_WIDTH[e]:
                    node.value = "".join(chunks)
                    return ParseResult(node, i, Status.MORE)
                code = int(digits, 16)
                chunks.append(chr(code) if code < 0x110000 and not 0xD800 <= code < 0xE000 else "\ufffd")
                i += 2 + len(digits)
                continue
            chunks.append(_ESCAPES.get(e, "\\" + e))  # Python keeps an unknown escape as written
            i += 2

    def sequence(self, pos: int, close: str) -> ParseResult:
        node, i = JArray(), skip_ws(self.text, pos + 1)
        while True:
            if i == self.n:
                return ParseResult(node, i, Status.MORE)
            if self.text[i] == close:
                node.closed = True
                return ParseResult(node, i + 1, Status.DONE)
            item = self.value(i)
            if item.node is not None:
                node.items.append(item.node)
            if item.status is not Status.DONE:
                return ParseResult(node, item.end, item.status)
            i = skip_ws(self.text, item.end)
            if i == self.n:
                return ParseResult(node, i, Status.MORE)
            if self.text[i] == ",":
                i = skip_ws(self.text, i + 1)
            elif self.text[i] != close:
                return ParseResult(node, i, Status.ERROR)

    def dict(self, pos: int) -> ParseResult:
        node, i = JObject(), skip_ws(self.text, pos + 1)
        while True:
            if i == self.n:
                return ParseResult(node, i, Status.MORE)
            if self.text[i] == "}":
                node.closed = True
                return ParseResult(node, i + 1, Status.DONE)
            if self.text[i] not in "'\"":
                return ParseResult(node, i, Status.ERROR)
            key = self.string(i)
            if key.node is None:
                return ParseResult(node, key.end, key.status)
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
            if self.text[i] == ",":
                i = skip_ws(self.text, i + 1)
            elif self.text[i] != "}":
                return ParseResult(node, i, Status.ERROR)


