"""Multi-LoRA: PEFT adapters applied per request, many adapters and the base model in one batch."""

from pagemill.lora.request import LoRARequest

__all__ = ["LoRARequest"]
