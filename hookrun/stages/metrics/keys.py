"""Where the metrics are stored: /metrics/<name> (the hooked model) and
/metrics/<name>_unhooked (the same rows without the run's hooks); /metrics/kl compares the
two."""

from __future__ import annotations

__all__ = ["METRICS_GROUP", "UNHOOKED", "metric_key"]

METRICS_GROUP = "metrics"
UNHOOKED = "_unhooked"


def metric_key(name: str, unhooked: bool = False) -> str:
    return f"{METRICS_GROUP}/{name}{UNHOOKED if unhooked else ''}"
