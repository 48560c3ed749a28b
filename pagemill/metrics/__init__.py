"""Serving metrics: per-iteration stats, Prometheus exposition and the periodic stats log line."""

from pagemill.metrics.logger import LoggingStatLogger
from pagemill.metrics.prometheus import PrometheusStatLogger
from pagemill.metrics.stats import FinishedRequestStats, IterationStats, StatLogger

__all__ = ["FinishedRequestStats", "IterationStats", "LoggingStatLogger", "PrometheusStatLogger", "StatLogger"]
