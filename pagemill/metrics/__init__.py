"""Serving metrics: stats types (stats.py), Prometheus exposition (prometheus.py), the periodic log line (logger.py)."""
