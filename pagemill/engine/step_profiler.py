"""Per-step time breakdown (schedule, input prep, forward, sampling, output processing) for --profile."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext


class StepProfiler:
    """Accumulates wall time per named section of the engine step; disabled it costs one nullcontext."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - start

    def section(self, name: str):
        """Context manager timing one section (a no-op when disabled)."""
        return self._timed(name) if self.enabled else nullcontext()

    def add(self, timings: dict[str, float]) -> None:
        """Add seconds measured elsewhere (the model runner's sections, from ModelRunnerOutput.timings)."""
        for name, seconds in timings.items():
            self.totals[name] += seconds

    def reset(self) -> None:
        """Forget what was measured."""
        self.totals.clear()
        self.steps = 0

    def report(self) -> dict[str, float]:
        """Milliseconds per step for each section, the total, and the share outside the model (forward + logits)."""
        steps = max(1, self.steps)
        out = {f"{k}_ms": 1e3 * v / steps for k, v in self.totals.items()}
        total = sum(self.totals.values())
        out["step_ms"] = 1e3 * total / steps
        model = self.totals.get("forward", 0.0) + self.totals.get("logits", 0.0)
        out["overhead_fraction"] = (total - model) / total if total else 0.0
        out["steps"] = self.steps
        return out
