"""The picture of experiment=induction: each head's induction score (layers × heads), the
score written in every cell — the heads that copy what followed a token's earlier copy."""

from __future__ import annotations

from pathlib import Path

import h5py
import matplotlib
import numpy as np

from hookrun.io.encoding import read_floats
from hookrun.render.pictures import save_figure
from hookrun.stages.induction.keys import INDUCTION_SCORE, induction_layers

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["render_induction"]


def render_induction(f: h5py.File, out_dir: Path) -> list[Path]:
    """`induction_scores.png` for a file with /induction/score; [] otherwise."""
    if INDUCTION_SCORE not in f:
        return []
    ds = f[INDUCTION_SCORE]
    score = np.asarray(read_floats(ds), dtype=np.float32)
    layers = induction_layers(f) or [str(i) for i in range(score.shape[0])]
    height, width = score.shape
    fig, ax = plt.subplots(figsize=(2.5 + 0.6 * width, 1.2 + 0.45 * height))
    image = ax.imshow(score, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    for (i, j), value in np.ndenumerate(score):
        colour = "black" if value > 0.6 else "white"
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color=colour)
    ax.set_yticks(range(height), layers, fontsize=7)
    ax.set_xticks(range(width), [str(h) for h in range(width)], fontsize=7)
    ax.set_xlabel("head")
    ax.set_title("induction score per head (Olsson et al. 2022)", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    target = out_dir / "induction_scores.png"
    save_figure(fig, target)
    return [target]
