"""The training curves of a job's dictionaries: loss, explained variance, L0 and the
fraction of dead latents against tokens seen, one line per dictionary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

from hookrun.render.pictures import save_figure

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["render_curves", "PICTURE"]

PICTURE = "train_sae_curves.png"
_PANELS = (
    ("mse", "MSE per token", True),
    ("explained_variance", "explained variance", False),
    ("l0", "L0 (latents per token)", True),
    ("dead", "dead latents (fraction)", False),
)


def render_curves(dictionaries: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """`train_sae_curves.png` from a training file's dictionaries; [] when none has a row."""
    drawn = [d for d in dictionaries if d["curves"]]
    if not drawn:
        return []
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(4 * len(_PANELS), 3.4))
    for ax, (key, label, log) in zip(axes, _PANELS, strict=True):
        for d in drawn:
            ax.plot(d["curves"]["tokens"], d["curves"][key], label=d["name"], linewidth=1.2)
        ax.set_xlabel("training tokens")
        ax.set_title(label, fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    return [save_figure(fig, out_dir / PICTURE)]
