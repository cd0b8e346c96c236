"""Sweeps: each job's outcome in its own directory, and one summary for the whole sweep.

A job that fails in a multirun records its traceback in its own log and a `failed` row, and
the sweep carries on; when every job is done, `sweep_summary.csv` in the sweep directory has
one row per job (overrides, status, rows, file), and the sweep exits non-zero if any failed.
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

__all__ = ["JOB_FILE", "write_job_summary", "SweepSummary"]

JOB_FILE = "job_summary.json"
log = logging.getLogger(__name__)


def write_job_summary(
    run_dir: Path, overrides: list[str], status: str, rows: int, path: Path | None, error: str
) -> None:
    """One job's row, written in its own directory (jobs may run in other processes)."""
    row = {
        "overrides": " ".join(overrides),
        "status": status,
        "rows": rows,
        "file": str(path or ""),
        "error": error,
    }
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
        with target.open("w", newline="") as f:
            writer = csv.DictWriter(f, ["job", "overrides", "status", "rows", "file", "error"])
            writer.writeheader()
            writer.writerows(rows)
        failed = [r for r in rows if r["status"] != "complete"]
        log.info("sweep: %d job(s), %d failed; summary in %s", len(rows), len(failed), target)
        if failed:
            print(
                f"hookrun: {len(failed)} of {len(rows)} jobs failed; see {target}", file=sys.stderr
            )
            sys.exit(1)


def _job_order(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (1 << 30, path.name)
