"""Data parallelism: one stat logger per engine, each batch of outputs accounted by its own engine's logger."""

from __future__ import annotations

from pagemill.metrics.stats import IterationStats, SchedulerStats, StatLogger


class PerEngineStatLogger:
    """Dispatches `record` to the logger of the engine a batch came from (vLLM keeps one per engine too)."""

    def __init__(self, loggers: list[StatLogger]) -> None:
        self.loggers = loggers

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats, now: float,
               engine_idx: int = 0) -> None:
        """Account one batch of outputs of engine `engine_idx`."""
        self.loggers[engine_idx].record(scheduler_stats, iteration, now, engine_idx=engine_idx)

    def render(self) -> bytes:
        """The Prometheus text of the (shared) registry, when the loggers are Prometheus ones."""
        return self.loggers[0].render()  # type: ignore[attr-defined]
