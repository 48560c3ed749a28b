"""Which device this process runs on: `current_platform`, chosen once, on first use (vLLM's `current_platform`).

$PAGEMILL_DEVICE picks it: auto (default), cpu or cuda. auto is the CPU: CUDA joins it once the CUDA platform is
implemented (cuda.py); until then PAGEMILL_DEVICE=cuda raises an error saying so.
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
    if requested == "cuda":
        from pagemill.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from pagemill.platforms.cpu import CpuPlatform

    return CpuPlatform()


def __getattr__(name: str) -> Any:
    # Resolved on first use, once per process (a platform holds no state that changes after that).
    global _current
    if name == "current_platform":
        if _current is None:
            _current = resolve_current_platform()
        return _current
    raise AttributeError(f"module 'pagemill.platforms' has no attribute {name!r}")
