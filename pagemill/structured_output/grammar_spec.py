"""GrammarSpec: a request's output constraint in canonical, hashable form (what a grammar backend compiles)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_XGRAMMAR_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: kind (json | json_object | regex | choice | grammar | structural_tag), its canonical text,
    and the JSON whitespace options. Hashable: it keys the compiled-grammar cache."""

    kind: str
    text: str
    any_whitespace: bool = True
    max_whitespace: int = 2
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False

    @property
    def field(self) -> str:
        """The request field this spec came from, for error messages."""
        return f"structured_outputs.{self.kind}"

    def error(self, message: str) -> ValueError:
        """A ValueError that names the field."""
        return ValueError(f"{self.field}: {_XGRAMMAR_LOG_PREFIX.sub('', str(message)).strip()}")
