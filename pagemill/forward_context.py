"""The per-step forward context: what every layer reads during one forward (attention metadata, LoRA mapping)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

_attn_metadata: Any = None
_lora_mapping: Any = None


@contextmanager
def set_forward_context(attn_metadata: Sequence[Any], lora_mapping: Any = None) -> Iterator[None]:
    """Make `attn_metadata` (one per KV cache group) and the step's LoRA mapping (None: no adapter in the step)
    visible to every layer for one forward."""
    global _attn_metadata, _lora_mapping
    prev = _attn_metadata, _lora_mapping
    _attn_metadata, _lora_mapping = attn_metadata, lora_mapping
    try:
        yield
    finally:
        _attn_metadata, _lora_mapping = prev


def get_attn_metadata() -> Sequence[Any]:
    """The metadata of the forward in progress, one per KV cache group."""
    if _attn_metadata is None:
        raise RuntimeError("Attention layers run only inside set_forward_context().")
    return _attn_metadata


def get_lora_mapping() -> Any:
    """The LoRA mapping of the forward in progress (pagemill.lora.layers.LoRAMapping), or None."""
    return _lora_mapping
