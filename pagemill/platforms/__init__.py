"""Which device this process runs on: `current_platform`, chosen once, on first use (vLLM's `current_platform`).

$PAGEMILL_DEVICE picks it: auto (default: CUDA when torch sees a GPU, else the CPU), cpu or cuda (an error saying so
where no GPU is visible). The engine argument `device` must agree with it (EngineArgs checks).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pagemill.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    current_platform: Platform

__all__ = ["Platform", "PlatformEnum", "current_platform", "resolve_current_platform"]

DEVICE_ENV = "PAGEMILL_DEVICE"
DEVICES = ("auto", "cpu", "cuda")

_current: Platform | None = None


def resolve_current_platform(requested: str | None = None) -> Platform:
    """The platform for `requested` (default: $PAGEMILL_DEVICE, else auto); a ValueError names an unknown one."""
    requested = (requested if requested is not None else os.environ.get(DEVICE_ENV, "auto")).strip().lower()
    requested = requested or "auto"
    if requested not in DEVICES:
        raise ValueError(f"{DEVICE_ENV} must be one of {', '.join(DEVICES)}, got {requested!r}.")
    if requested == "cuda" or (requested == "auto" and _cuda_visible()):
        from pagemill.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from pagemill.platforms.cpu import CpuPlatform

    return CpuPlatform()


def _cuda_visible() -> bool:
    """Whether auto means CUDA: a CUDA build of torch that sees a device (CPU builds answer without touching CUDA)."""
    import torch

    return torch.version.cuda is not None and torch.cuda.is_available()


def __getattr__(name: str) -> Any:
    # Resolved on first use, once per process (a platform holds no state that changes after that).
    global _current
    if name == "current_platform":
        if _current is None:
            _current = resolve_current_platform()
        return _current
    raise AttributeError(f"module 'pagemill.platforms' has no attribute {name!r}")
