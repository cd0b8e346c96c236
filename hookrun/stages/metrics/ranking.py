"""A sweep's jobs ranked by what their intervention changed: one row per job that computed
metrics, largest first by the change (hooked − unhooked, mean over rows) of the metric
`metrics.rank_by` — for a sweep over heads ablated with `loss`, the heads the model needs
most come first. Written as metrics_ranking.csv and .md in the sweep directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hookrun.io.layout import attr, open_readonly
from hookrun.render.tables import ranked, write_table
from hookrun.stages.metrics.keys import METRICS_GROUP

__all__ = ["write_metrics_ranking", "RANK_BY"]

RANKING = "metrics_ranking"
RANK_BY = "rank_by"  # the /metrics group's attribute: the metric the sweep ranks by


def _rank_by(path: Path) -> str | None:
    with open_readonly(path) as f:
        group = f.get(METRICS_GROUP)
        return None if group is None else attr(group, RANK_BY)


def write_metrics_ranking(sweep_dir: Path, jobs: list[dict[str, Any]]) -> list[Path]:
    """metrics_ranking.csv and .md from the sweep's job rows; nothing when no job has
    metrics."""
    rows, metric = [], None
    for job in jobs:
        if job.get("status") != "complete" or not job.get("file"):
            continue
        name = _rank_by(Path(job["file"]))
        if name is None:
            continue
        metric = metric or str(name)
        means = job.get("evaluation", {}).get("means", {})
        nan = float("nan")
        rows.append(
            {
                "job": job["job"],
                "change": means.get(f"metrics:{name}_change", nan),
                "hooked": means.get(f"metrics:{name}", nan),
                "unhooked": means.get(f"metrics:{name}_unhooked", nan),
                "kl": means.get("metrics:kl", nan),
                "overrides": job["overrides"],
            }
        )
    if not rows:
        return []
    columns = ["rank", "job", "change", "hooked", "unhooked", "kl", "overrides"]
    title = (
        f"Metrics ranking by the change of {metric} (hooked - unhooked, mean over rows; "
        "largest first)"
    )
    return write_table(sweep_dir, RANKING, ranked(rows, "change"), columns, title)
