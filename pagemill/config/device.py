"""DeviceConfig: the device the model, KV cache and step buffers live on, and the worker class that drives it."""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_TYPES = ("cpu", "cuda")


@dataclass
class DeviceConfig:
    """The resolved device (the platform's torch device type; EngineArgs.device may say auto), the worker class by
    import path (auto: the platform's Platform.worker_cls) and whether steps run eagerly (no CUDA graphs, no CPU
    decoder graph)."""

    device: str = "cpu"
    worker_cls: str = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.device not in DEVICE_TYPES:
            raise ValueError(f"device must be one of {', '.join(DEVICE_TYPES)} once resolved, got {self.device!r}.")
