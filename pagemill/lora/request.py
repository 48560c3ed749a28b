"""LoRARequest: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """A PEFT adapter directory by name and a unique positive integer id (the id keys the engine's caches)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not self.lora_name:
            raise ValueError("lora_request.lora_name must not be empty.")

    @property
    def adapter_id(self) -> int:
        """The adapter's integer id (vLLM's alias)."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """The adapter's name."""
        return self.lora_name

    @property
    def path(self) -> str:
        """The adapter's directory."""
        return self.lora_path
