"""The picture of a run's dictionary scores: L0 against CE loss recovered, one point per
spliced dictionary (the trade-off a dictionary is chosen by: fewer latents per token, more of
the model's loss recovered)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

from hookrun.render.pictures import save_figure

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["render_scores", "render_ranking", "PICTURE"]

PICTURE = "sae_scores.png"


def render_scores(scores: dict[str, dict[str, float]], out_dir: Path) -> list[Path]:
    """`sae_scores.png`: L0 against CE loss recovered (or explained variance where no CE was
    measured) for each dictionary; [] when the run scored none."""
    if not scores:
        return []
    with_ce = all(np.isfinite(s["ce_loss_score"]) for s in scores.values())
    y_name = "ce_loss_score" if with_ce else "explained_variance"
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for site, score in scores.items():
        ax.scatter(score["l0"], score[y_name], s=30)
        ax.annotate(
            site,
            (score["l0"], score[y_name]),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.set_xlabel("L0 (latents active per token)")
    ax.set_ylabel("CE loss recovered" if with_ce else "explained variance")
    ax.set_title("dictionary scores over the run's tokens", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return [save_figure(fig, Path(out_dir) / PICTURE)]


def render_ranking(rows: list[dict], by: str, target: Path) -> Path:
    """A sweep's dictionaries: L0 against `by`, a point per job and site, its rank beside."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for row in rows:
        ax.scatter(row["l0"], row[by], s=30)
        label = f"{row['rank']}: job {row['job']}"
        ax.annotate(
            label, (row["l0"], row[by]), fontsize=7, xytext=(4, 4), textcoords="offset points"
        )
    ax.set_xlabel("L0 (latents active per token)")
    ax.set_ylabel("CE loss recovered" if by == "ce_loss_score" else "explained variance")
    ax.set_title("a sweep's dictionaries (rank: sae_ranking.csv)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, target)
