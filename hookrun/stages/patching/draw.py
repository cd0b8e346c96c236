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
from hookrun.stages.patching.config import APPROXIMATIONS, SITE_KINDS
from hookrun.stages.patching.keys import PATCHING, PEARSON, SPEARMAN, patching_key, read_patching

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
        for suffix in ("", *(f"_{m}" for m in APPROXIMATIONS)):
            key = patching_key(kind, suffix)
            if key in f and f[layout.SAMPLES_INDEX].shape[0]:
                drawn.append(_grid_picture(f, out_dir, config, f"{kind}{suffix}"))
        drawn += _agreement_picture(f, out_dir, kind)
    return drawn


def _grid_picture(f: h5py.File, out_dir: Path, config: dict, kind: str) -> Path:
    """patching_<kind>.png: the grid averaged over rows, and the first row's."""
    ds = f[patching_key(kind)]
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
    return save_figure(fig, out_dir / f"patching_{kind}.png")


def _agreement_picture(f: h5py.File, out_dir: Path, kind: str) -> list[Path]:
    """patching_<kind>_agreement.png: each approximation's score against the exact one,
    cell by cell over every row (the diagonal: equal), with its correlations."""
    exact_key = patching_key(kind)
    found = [m for m in APPROXIMATIONS if patching_key(kind, f"_{m}") in f]
    if exact_key not in f or not found:
        return []
    exact = read_floats(f[exact_key]).ravel()
    fig, axes = plt.subplots(1, len(found), figsize=(4.2 * len(found), 4.0), squeeze=False)
    for ax, method in zip(axes[0], found, strict=True):
        ds = f[patching_key(kind, f"_{method}")]
        approx = read_floats(ds).ravel()
        both = np.isfinite(exact) & np.isfinite(approx)
        ax.scatter(exact[both], approx[both], s=6, alpha=0.5)
        if both.any():
            low = float(min(exact[both].min(), approx[both].min()))
            high = float(max(exact[both].max(), approx[both].max()))
            ax.plot([low, high], [low, high], color="0.5", linewidth=0.8)
        pearson, spearman = layout.attr(ds, PEARSON), layout.attr(ds, SPEARMAN)
        said = (
            f"Pearson {float(pearson):.3f}, Spearman {float(spearman):.3f}"
            if pearson is not None
            else ""
        )
        ax.set_title(f"{kind}: {method} against exact\n{said}", fontsize=8)
        ax.set_xlabel("exact score", fontsize=8)
        ax.set_ylabel(f"{method} score", fontsize=8)
    fig.tight_layout()
    return [save_figure(fig, out_dir / f"patching_{kind}_agreement.png")]
