"""Wall time of the model runner's own sections in one step; the seconds travel back in ModelRunnerOutput."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import ContextManager


class StepTimer:
    """Accumulates seconds per named section until `take()`; disabled it costs one nullcontext per section."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.timings: dict[str, float] = {}

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start

    def section(self, name: str) -> ContextManager[None]:
        """Context manager timing one section (a no-op when disabled)."""
        return self._timed(name) if self.enabled else nullcontext()

    def take(self) -> dict[str, float]:
        """The seconds per section since the last call (empty when disabled)."""
        out, self.timings = self.timings, {}
        return out
