"""A steering sweep's jobs ranked: one row per job (its layers and scale, read from its
file), best first by the effect — the change of `steering.effect` the vector made, mean
over rows — beside the fluency of the text it generated (mean log probability of the
generated tokens under the model without hooks) and the KL divergence of the steered
next-token distribution with the plain model's as the reference (metrics' `kl`).
Written as steering_ranking.csv and .md, and steering_ranking.png: effect against fluency,
one line per layer through its scales."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from hookrun.io.layout import attr, open_readonly
from hookrun.render.tables import ranked, write_table
from hookrun.stages.steering.keys import STEERING, VECTORS

__all__ = ["write_steering_ranking", "RANKING"]

RANKING = "steering_ranking"
_COLUMNS = ["rank", "job", "layers", "scale", "effect", "fluency", "kl", "metric", "overrides"]


def _job_row(job: dict[str, Any]) -> dict[str, Any] | None:
    """A complete job's row, or None when its file holds no steering vector."""
    with open_readonly(Path(job["file"])) as f:
        if VECTORS not in f:
            return None
        group = f[STEERING]
        effect, scale = str(attr(group, "effect")), float(attr(group, "scale"))
        layers = ", ".join(str(x) for x in attr(group, "layers"))
    means = job.get("evaluation", {}).get("means", {})
    nan = float("nan")
    return {
        "job": job["job"],
        "layers": layers,
        "scale": scale,
        "effect": means.get(f"metrics:{effect}_change", nan),
        "fluency": means.get("generate:fluency", nan),
        "kl": means.get("metrics:kl", nan),
        "metric": effect,
        "overrides": job["overrides"],
    }


def write_steering_ranking(sweep_dir: Path, jobs: list[dict[str, Any]]) -> list[Path]:
    """steering_ranking.csv, .md and .png from the sweep's job rows (each: job, overrides,
    status, file and its `evaluation` means); nothing when no job steered."""
    done = [j for j in jobs if j.get("status") == "complete" and j.get("file")]
    rows = [row for job in done if (row := _job_row(job)) is not None]
    if not rows:
        return []
    rows = ranked(rows, "effect")
    metric = rows[0]["metric"]
    title = (
        f"Steering ranking by effect: the change of {metric} (mean over rows; higher is "
        "stronger); fluency: the generated tokens' mean log probability under the model "
        "without hooks (higher is more fluent)"
    )
    csv_path, md_path = write_table(sweep_dir, RANKING, rows, _COLUMNS, title)
    return [csv_path, md_path, _picture(sweep_dir / f"{RANKING}.png", rows, metric)]


def _picture(target: Path, rows: list[dict[str, Any]], metric: str) -> Path:
    """Effect (y) against fluency (x): a line per layer through its scales, each point
    labelled with its scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_layer: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_layer[r["layers"]].append(r)
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for layer, points in sorted(by_layer.items()):
        points.sort(key=lambda r: r["scale"])
        xs, ys = [p["fluency"] for p in points], [p["effect"] for p in points]
        ax.plot(xs, ys, marker="o", label=layer)
        for p in points:
            ax.annotate(
                f"x{p['scale']:g}",
                (p["fluency"], p["effect"]),
                fontsize=8,
                textcoords="offset points",
                xytext=(4, 4),
            )
    ax.axhline(0.0, color="0.6", linewidth=0.8)
    ax.set_xlabel("fluency: generated tokens' mean log prob. under the model without hooks")
    ax.set_ylabel(f"effect: change of {metric} (steered - unsteered)")
    ax.set_title("steering: effect against fluency, per layer and scale")
    ax.legend(title="layer", fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
