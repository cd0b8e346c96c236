"""The pictures of an activation patching run (experiment=lm_patching): per site kind, the
layers × positions grid of (patched − corrupted) / (clean − corrupted), averaged over rows
and for the first row, with the first row's tokens as the position labels.

The rows are prompts of different lengths padded on the right, each read at its last token.
With every position patched, the mean lines the rows up at their read position — its
columns are positions counted back from it (read, −1, −2, ...) — so the read column
averages every row's read, not row 0's read with other rows' middles; a column that fewer
rows reach (a longer row's start) says how many it holds. With listed positions (inside
every row) the columns are those positions."""

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

__all__ = ["render_patching", "read_aligned"]


def _labels(f: h5py.File, positions: np.ndarray, config: dict) -> list[str]:
    """Each patched position as `<position> <the first row's token there>`."""
    ids = f[layout.SAMPLES_TOKENS][0]
    texts = token_texts(f, config, ids[positions])
    return [f"{p} {t}" for p, t in zip(positions.tolist(), texts, strict=True)]


def _reads(f: h5py.File) -> np.ndarray:
    """Each row's read position: its last real token (/samples/mask; unpadded: the last)."""
    ids = f[layout.SAMPLES_TOKENS]
    if layout.SAMPLES_MASK not in f:
        return np.full(ids.shape[0], ids.shape[1] - 1, dtype=np.int64)
    mask = f[layout.SAMPLES_MASK][()].astype(bool)
    return mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)


def read_aligned(
    scores: np.ndarray, reads: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row's cells (scores (N, sites, positions): positions 0 … T−1) lined up at its read
    position: (N, sites, columns) with column j at position read + offsets[j] (offsets from
    the most any row has before its read, to the most after), NaN where a row has no cell
    there; and each column's rows holding a number (finite at some site)."""
    n, sites, width = scores.shape
    offsets = np.arange(-int(reads.max()), width - int(reads.min()))
    at = reads[:, None] + offsets[None, :]  # (N, columns): each row's position per column
    inside = (at >= 0) & (at < width)
    taken = np.take_along_axis(scores, np.clip(at, 0, width - 1)[:, None, :].repeat(sites, 1), 2)
    aligned = np.where(inside[:, None, :], taken, np.nan)
    holding = np.isfinite(aligned).any(axis=1).sum(axis=0)
    keep = holding > 0  # columns no row reaches (past every row's last token) left out
    return aligned[..., keep], offsets[keep], holding[keep]


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
    first = int(f[layout.SAMPLES_INDEX][0])
    mean, mean_labels, title = _mean_over_rows(f, scores, positions, labels, config)
    fig, axes = plt.subplots(
        2,
        1,
        figsize=(
            max(6, 0.35 * max(len(labels), len(mean_labels)) + 3),
            2 + min(0.8, 6 / len(names) + 0.12) * len(names),
        ),
    )
    for ax, grid, said, shown in (
        (axes[0], mean, f"{kind}: {title}", mean_labels),
        (axes[1], scores[0], f"{kind}: row {first}", labels),
    ):
        image = _panel(ax, grid, (names, shown), said)
        fig.colorbar(image, ax=ax, fraction=0.02)
    fig.suptitle(
        "(patched − corrupted) / (clean − corrupted) logit difference; clean = prompt, "
        "corrupted = counterfactual",
        fontsize=8,
    )
    fig.tight_layout()
    return save_figure(fig, out_dir / f"patching_{kind}.png")


def _mean_over_rows(
    f: h5py.File, scores: np.ndarray, positions: np.ndarray, labels: list[str], config: dict
) -> tuple[np.ndarray, list[str], str]:
    """The mean panel's grid (sites, columns), its column labels and its title: with every
    position patched, the rows lined up at their read positions (read_aligned), a column
    labelled by its offset from the read, row 0's token there, and [n] where only n of the
    scored rows reach it; with listed positions (inside every row), those positions."""
    first = int(f[layout.SAMPLES_INDEX][0])
    rows = int(np.isfinite(scores).any(axis=(1, 2)).sum())  # unscorable rows: NaN throughout
    with warnings.catch_warnings():  # a column some rows do not reach: NaN there, no warning
        warnings.simplefilter("ignore", RuntimeWarning)
        if positions.tolist() != list(range(f[layout.SAMPLES_TOKENS].shape[1])):
            return (
                np.nanmean(scores, axis=0),
                labels,
                f"mean over {rows} rows (tokens of row {first})",
            )
        reads = _reads(f)[: len(scores)]
        aligned, offsets, holding = read_aligned(scores, reads)
        mean = np.nanmean(aligned, axis=0)
    texts = token_texts(f, config, f[layout.SAMPLES_TOKENS][0])
    shown = []
    for offset, held in zip(offsets.tolist(), holding.tolist(), strict=True):
        at = int(reads[0]) + offset  # row 0's position in this column
        said = ("read" if offset == 0 else f"{offset:+d}") + (f" {texts[at]}" if at >= 0 else "")
        shown.append(said + (f" [{held}]" if held < rows else ""))
    title = (
        f"mean over {rows} rows, each lined up at its read position (its last token; tokens "
        f"of row {first}; [n]: a column only n rows reach)"
    )
    return mean, shown, title


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
