"""A sweep over dictionaries ranked: one row per (job, spliced site), by CE loss recovered
(explained variance where no CE was measured), largest first, with L0 beside it — the
trade-off a dictionary is chosen by. Written as sae_ranking.csv and .md in the sweep
directory, and sae_ranking.png (L0 against the score, a point per job and site)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hookrun.render.tables import ranked, write_table

__all__ = ["write_sae_ranking"]

RANKING = "sae_ranking"
PREFIX = "sae:"


def write_sae_ranking(sweep_dir: Path, jobs: list[dict[str, Any]]) -> list[Path]:
    """sae_ranking.csv, .md and .png from the sweep's job rows (their `sae:<site>:<score>`
    columns); nothing when no job scored a dictionary."""
    rows = []
    for job in jobs:
        if job.get("status") != "complete":
            continue
        means = job.get("evaluation", {}).get("means", {})
        sites = sorted({k[len(PREFIX) :].rsplit(":", 1)[0] for k in means if k.startswith(PREFIX)})
        for site in sites:
            score = {
                k.rsplit(":", 1)[1]: v for k, v in means.items() if k.startswith(f"{PREFIX}{site}:")
            }
            rows.append(
                {
                    "job": job["job"],
                    "site": site,
                    "ce_loss_score": score.get("ce_loss_score", math.nan),
                    "explained_variance": score.get("explained_variance", math.nan),
                    "l0": score.get("l0", math.nan),
                    "kl_div_score": score.get("kl_div_score", math.nan),
                    "dead": score.get("dead", math.nan),
                    "overrides": job["overrides"],
                }
            )
    if not rows:
        return []
    by = (
        "ce_loss_score"
        if all(math.isfinite(r["ce_loss_score"]) for r in rows)
        else "explained_variance"
    )
    columns = [
        "rank",
        "job",
        "site",
        by,
        "l0",
        "explained_variance",
        "kl_div_score",
        "dead",
        "overrides",
    ]
    columns = list(dict.fromkeys(columns))
    title = f"Dictionaries ranked by {by} (largest first), with L0 (latents per token)"
    order = ranked(rows, by)
    written = write_table(sweep_dir, RANKING, order, columns, title)
    from hookrun.stages.sae.draw import render_ranking  # matplotlib: when drawing

    return [*written, render_ranking(order, by, sweep_dir / f"{RANKING}.png")]
