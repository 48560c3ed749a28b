"""LoRAConfig: adapter slots one step can mix and adapters kept on the host (EngineArgs' LoRA fields)."""

from __future__ import annotations

from dataclasses import dataclass

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoRAConfig:
    """Multi-LoRA serving: adapter slots applied in one batch (each holds a slot in the stacked LoRA weights, slots
    max_lora_rank wide), and adapters kept on the host (LRU) beyond them."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # resolved: max_loras when not given

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}.")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {LORA_RANKS}, got {self.max_lora_rank}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
