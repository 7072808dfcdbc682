"""Metrics: the Ray dashboard's (RoundMetrics) and Prometheus' (/metrics)."""
