"""Which layer and which method to trust: a sweep's jobs ranked by their evaluation.

Each job's summary row carries the mean over samples of every per-sample number its
captures.h5 holds under /evaluate (a deletion or insertion AUC, a ROAD score: column
`<metric>:<attribution path>`), read from the complete file (the sanity check's verdict
scores join as its stage's columns, `sanity:<method>`). The sweep then writes `sweep_ranking.csv`
and `.md` — one row per job and attribution, best first by `evaluate.rank_by` — and
`sweep_ranking.png`, a layer × method heat map of the ranking metric.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from hookrun.io import layout, walk
from hookrun.render.tables import ranked, write_table
from hookrun.stages.evaluate.config import parse_evaluate
from hookrun.stages.evaluate.keys import EVALUATE
from hookrun.stages.evaluate.registry import FAITHFULNESS_METRICS

__all__ = ["job_means", "write_ranking"]

RANKING = "sweep_ranking"


def _split(attribution: str, experiment: str) -> tuple[str, str]:
    """(method, layer) of an attribution path: derived/<method>/<layer>, or the
    experiment's name and `input` for a captured input gradient."""
    parts = attribution.split("/")
    if parts[0] == "derived" and len(parts) >= 3:
        return parts[1], "/".join(parts[2:])
    return experiment or "input gradient", "input"


def job_means(path: Path) -> dict[str, Any]:
    """A complete job's evaluation means (column → mean), its ranking metric (`rank_by`)
    and what each attribution is (`attributions`: path → (method, layer))."""
    out: dict[str, Any] = {"means": {}, "attributions": {}, "rank_by": None}
    with layout.open_readonly(path) as f:
        state = layout.read_state(f)
        rows = state.completed
        for metric, datasets in walk.group_of(f, EVALUATE).items():
            for name, ds in datasets.items():
                suffix = (
                    FAITHFULNESS_METRICS.get(metric, "evaluate").summary_suffix
                    if metric in FAITHFULNESS_METRICS
                    else ""
                )
                if ds.ndim != 1 or not suffix or not name.endswith(suffix):
                    continue
                attribution = name.removesuffix(suffix)
                values = ds[:rows].astype(np.float64)
                out["means"][f"{metric}:{attribution}"] = float(np.mean(values))
                out["attributions"][attribution] = _split(attribution, state.experiment)
        config = OmegaConf.to_container(OmegaConf.create(state.config or "{}"))
    spec = parse_evaluate((config or {}).get("evaluate")) if out["attributions"] else None
    out["rank_by"] = spec.rank_by if spec else None
    return out


def _natural(name: str) -> list:
    """features.2 before features.16."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def write_ranking(sweep_dir: Path, jobs: list[dict[str, Any]]) -> list[Path]:
    """sweep_ranking.csv, .md and .png from the jobs' rows (each: job, overrides, status
    and its `evaluation` from job_means); nothing when no job evaluated anything."""
    done = [j for j in jobs if j.get("status") == "complete" and j.get("evaluation")]
    rank_by = next((j["evaluation"]["rank_by"] for j in done if j["evaluation"]["rank_by"]), None)
    if rank_by is None:
        return []
    metrics = [m for m in FAITHFULNESS_METRICS.choices()]
    rows = []
    for job in done:
        ev = job["evaluation"]
        for attribution, (method, layer) in ev["attributions"].items():
            row = {"job": job["job"], "overrides": job["overrides"], "method": method}
            row |= {"layer": layer, "attribution": attribution}
            row |= {m: ev["means"].get(f"{m}:{attribution}", float("nan")) for m in metrics}
            rows.append(row)
    higher = FAITHFULNESS_METRICS.get(rank_by, "evaluate.rank_by").higher_is_better
    rows = ranked(rows, rank_by, higher)
    columns = ["rank", "job", "method", "layer", *metrics, "attribution", "overrides"]
    order = "higher" if higher else "lower"
    title = f"Sweep ranking by {rank_by} (mean over samples; {order} is better)"
    csv_path, md_path = write_table(sweep_dir, RANKING, rows, columns, title)
    return [csv_path, md_path, _heat_map(sweep_dir / f"{RANKING}.png", rows, rank_by, order)]


def _heat_map(target: Path, rows: list[dict[str, Any]], rank_by: str, order: str) -> Path:
    """Layer × method, each cell the mean of `rank_by` over the jobs that share it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        cells[(r["layer"], r["method"])].append(r[rank_by])
    layers = sorted({r["layer"] for r in rows}, key=_natural)
    methods = sorted({r["method"] for r in rows})
    grid = np.full((len(layers), len(methods)), np.nan)
    for (layer, method), values in cells.items():
        grid[layers.index(layer), methods.index(method)] = np.mean(values)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(methods), 1.2 + 0.6 * len(layers)))
    image = ax.imshow(grid, cmap="viridis" if order == "higher" else "viridis_r", aspect="auto")
    ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
    ax.set_yticks(range(len(layers)), layers)
    low, span = np.nanmin(grid), (np.nanmax(grid) - np.nanmin(grid)) or 1.0
    for (i, j), value in np.ndenumerate(grid):
        if np.isfinite(value):
            place = (value - low) / span  # where on viridis: dark text on its light end
            light = place > 0.6 if order == "higher" else place < 0.4
            colour = "k" if light else "w"
            ax.text(j, i, f"{value:.3f}", ha="center", va="center", color=colour, fontsize=8)
    fig.colorbar(image, ax=ax, label=f"{rank_by} ({order} is better)")
    ax.set_title(f"sweep ranking: {rank_by}")
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
