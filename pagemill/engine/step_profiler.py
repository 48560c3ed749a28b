"""Per-step time breakdown (schedule, input prep, forward, sampling, output processing) for --profile."""

from __future__ import annotations

from pagemill.worker.step_timer import StepTimer


class StepProfiler(StepTimer):
    """The engine core's StepTimer: its own sections plus the runner's (`add`), reported per step."""

    # Sections run in a background thread, overlapped with others: reported, but not part of the step's total.
    OVERLAPPED = frozenset({"grammar_fill"})

    # The model runner's sections (async scheduling: they run in the step thread, under the engine's "wait").
    RUNNER = frozenset({"prepare", "forward", "logits", "sample", "propose", "grammar_fill"})

    def __init__(self, enabled: bool = False, overlapped_runner: bool = False) -> None:
        super().__init__(enabled)
        self.steps = 0
        # Async scheduling: a step's wall time is the engine thread's (schedule, update, output, wait); the runner's
        # sections overlap it, so they are reported but not added to the total.
        self.overlapped_runner = overlapped_runner

    def add(self, timings: dict[str, float]) -> None:
        """Add seconds measured elsewhere (the model runner's sections, from ModelRunnerOutput.timings)."""
        for name, seconds in timings.items():
            self.timings[name] = self.timings.get(name, 0.0) + seconds

    def reset(self) -> None:
        """Forget what was measured."""
        self.timings.clear()
        self.steps = 0

    def report(self) -> dict[str, float]:
        """Milliseconds per step for each section, the total, and the share outside the model (forward + logits)."""
        steps = max(1, self.steps)
        out = {f"{k}_ms": 1e3 * v / steps for k, v in self.timings.items()}
        skip = self.OVERLAPPED | self.RUNNER if self.overlapped_runner else self.OVERLAPPED
        total = sum(v for k, v in self.timings.items() if k not in skip)
        out["step_ms"] = 1e3 * total / steps
        model = self.timings.get("forward", 0.0) + self.timings.get("logits", 0.0)
        out["overhead_fraction"] = max(0.0, total - model) / total if total else 0.0
        out["steps"] = self.steps
        return out
