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

    def set_kv_capacity(self, total_blocks: int) -> None:
        """Each engine's pool size before its first stats (the engines have the same pool)."""
        for logger in self.loggers:
            logger.set_kv_capacity(total_blocks)  # type: ignore[attr-defined]

    def mark_engine_dead(self) -> None:
        """The front end failed: every engine's gauges say so."""
        for logger in self.loggers:
            logger.mark_engine_dead()  # type: ignore[attr-defined]

    def render(self) -> bytes:
        """The Prometheus text of the (shared) registry, when the loggers are Prometheus ones."""
        return self.loggers[0].render()  # type: ignore[attr-defined]
