"""Sweeps: each job's outcome in its own directory, and one summary for the whole sweep.

A job that fails in a multirun records its traceback in its own log and a `failed` row, and
the sweep carries on; when every job is done, `sweep_summary.csv` in the sweep directory has
one row per job (overrides, status, rows, file, and one column per evaluation metric and
attribution, each stage's columns: the mean over samples its file holds), each stage ranks
the jobs it ran in (Stage.rank: the evaluated attributions, stages/evaluate/ranking.py; the
steered layers and scales, stages/steering/ranking.py), and the sweep exits non-zero if any
failed.
"""

from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from hookrun.io.layout import open_readonly, read_state
from hookrun.stage import stage_columns, stages
from hookrun.stages.evaluate.ranking import job_means

__all__ = ["JOB_FILE", "write_job_summary", "SweepSummary"]

JOB_FILE = "job_summary.json"
log = logging.getLogger(__name__)


def write_job_summary(
    run_dir: Path, overrides: list[str], status: str, rows: int, path: Path | None, error: str
) -> None:
    """One job's row, written in its own directory (jobs may run in other processes); a
    complete job's evaluation means are read from its file here (under torchrun: rank 0's
    joined file over every shard)."""
    row: dict[str, Any] = {
        "overrides": " ".join(overrides),
        "status": status,
        "rows": rows,
        "file": str(path or ""),
        "error": error,
    }
    if status == "complete" and path is not None:
        row["evaluation"] = job_means(path)
        with open_readonly(path) as f:
            row["evaluation"]["means"] |= stage_columns(f, read_state(f).completed)
    (run_dir / JOB_FILE).write_text(json.dumps(row))


class SweepSummary(Callback):
    """Hydra callback: gathers every job's row into `<sweep dir>/sweep_summary.csv`."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = []
        for job_dir in sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=_job_order):
            if not (job_dir / ".hydra").is_dir():
                continue  # not a job directory (e.g. .submitit)
            summary = job_dir / JOB_FILE
            if summary.is_file():
                rows.append({"job": job_dir.name, **json.loads(summary.read_text())})
            else:  # killed before it could say anything
                rows.append(
                    {
                        "job": job_dir.name,
                        "overrides": "",
                        "status": "no result",
                        "rows": 0,
                        "file": "",
                        "error": f"see {job_dir}",
                    }
                )
        target = sweep_dir / "sweep_summary.csv"
        means = [r.get("evaluation", {}).get("means", {}) for r in rows]
        extra = sorted({column for m in means for column in m})
        with target.open("w", newline="") as f:
            columns = ["job", "overrides", "status", "rows", "file", "error", *extra]
            writer = csv.DictWriter(f, columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows({**r, **m} for r, m in zip(rows, means, strict=True))
        for stage in stages():
            ranked = stage.rank(sweep_dir, rows)
            if ranked:
                log.info("sweep: %s ranking in %s", stage.name, ranked[1])
        failed = [r for r in rows if r["status"] != "complete"]
        log.info("sweep: %d job(s), %d failed; summary in %s", len(rows), len(failed), target)
        if failed:
            print(
                f"hookrun: {len(failed)} of {len(rows)} jobs failed; see {target}", file=sys.stderr
            )
            sys.exit(1)


def _job_order(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (1 << 30, path.name)
