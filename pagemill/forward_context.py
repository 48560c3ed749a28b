"""The per-step forward context: attention metadata that Attention layers read during a forward."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

_forward_context: Any = None


@contextmanager
def set_forward_context(attn_metadata: Sequence[Any]) -> Iterator[None]:
    """Make `attn_metadata` (one per KV cache group) visible to every Attention layer for one forward."""
    global _forward_context
    prev, _forward_context = _forward_context, attn_metadata
    try:
        yield
    finally:
        _forward_context = prev


def get_attn_metadata() -> Sequence[Any]:
    """The metadata of the forward in progress, one per KV cache group."""
    if _forward_context is None:
        raise RuntimeError("Attention layers run only inside set_forward_context().")
    return _forward_context
