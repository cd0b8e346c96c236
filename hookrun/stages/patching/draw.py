"""The pictures of an activation patching run (experiment=lm_patching): per site kind, the
layers × positions grid of (patched − corrupted) / (clean − corrupted), averaged over rows
and for the first row, with the first row's tokens as the position labels."""

from __future__ import annotations

import warnings
from pathlib import Path

import h5py
import matplotlib
import numpy as np

from hookrun.io import layout
from hookrun.io.encoding import read_floats
from hookrun.render.pictures import save_figure
from hookrun.render.tokens import token_texts
from hookrun.stages.patching.config import SITE_KINDS
from hookrun.stages.patching.keys import PATCHING, patching_key, read_patching

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["render_patching"]


def _labels(f: h5py.File, positions: np.ndarray, config: dict) -> list[str]:
    """Each patched position as `<position> <the first row's token there>`."""
    ids = f[layout.SAMPLES_TOKENS][0]
    texts = token_texts(config, ids[positions])
    return [f"{p} {t}" for p, t in zip(positions.tolist(), texts, strict=True)]


def _panel(ax: plt.Axes, grid: np.ndarray, rows: tuple[list[str], list[str]], title: str):
    """One heatmap, 0 white, 1 (the clean answer back whole) full red."""
    layers, labels = rows
    top = max(1.0, float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0)
    image = ax.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=-top, vmax=top)
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=90)
    ax.set_title(title, fontsize=8)
    return image


def render_patching(f: h5py.File, out_dir: Path, config: dict) -> list[Path]:
    """`patching_<site kind>.png` for each grid the file holds; [] without patching."""
    if PATCHING not in f or layout.SAMPLES_TOKENS not in f:
        return []
    drawn: list[Path] = []
    for kind in SITE_KINDS:
        key = patching_key(kind)
        if key not in f or not f[layout.SAMPLES_INDEX].shape[0]:
            continue
        ds = f[key]
        scores = read_floats(ds)
        names, positions = read_patching(ds)
        labels = _labels(f, positions, config)
        if scores.ndim == 4:  # heads: (N, layers, heads, positions), a row per head
            names = [f"{name} h{h}" for name in names for h in range(scores.shape[2])]
            scores = scores.reshape(scores.shape[0], len(names), scores.shape[3])
        with warnings.catch_warnings():  # a cell past every row's tokens: NaN, not a warning
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(scores, axis=0)
        fig, axes = plt.subplots(
            2,
            1,
            figsize=(
                max(6, 0.35 * len(labels) + 3),
                2 + min(0.8, 6 / len(names) + 0.12) * len(names),
            ),
        )
        first = int(f[layout.SAMPLES_INDEX][0])
        for ax, grid, title in (
            (axes[0], mean, f"{kind}: mean over {len(scores)} rows (tokens of row {first})"),
            (axes[1], scores[0], f"{kind}: row {first}"),
        ):
            image = _panel(ax, grid, (names, labels), title)
            fig.colorbar(image, ax=ax, fraction=0.02)
        fig.suptitle(
            "(patched − corrupted) / (clean − corrupted) logit difference; clean = prompt, "
            "corrupted = counterfactual",
            fontsize=8,
        )
        fig.tight_layout()
        target = out_dir / f"patching_{kind}.png"
        save_figure(fig, target)
        drawn.append(target)
    return drawn
