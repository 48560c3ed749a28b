"""Config objects from what users pass: a dict, its JSON text (a CLI flag), or the object itself."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def config_from_user(cls: type[T], value: dict[str, Any] | str, name: str, known: set[str] | None = None) -> T:
    """`cls(**value)` from a dict or its JSON text; a ValueError naming `name` for bad JSON, a non-object or
    keys outside `known` (default: the dataclass's fields)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or its JSON text, got {type(value).__name__}.")
    known = known if known is not None else {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known: {sorted(known)}.")
    return cls(**value)
