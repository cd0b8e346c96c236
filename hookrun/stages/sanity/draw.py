"""The sanity check's pictures, drawn from the finished file:

- `sanity_grid.png`: Adebayo et al.'s grid for the first sample (rows: methods; columns:
  the original model, then each randomisation step), from /sanity/<method>/maps, each |map|
  clipped at its 99th percentile;
- `sanity_similarity.png`: each similarity's median over samples against the step.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import matplotlib
import numpy as np

from hookrun.io import layout, walk
from hookrun.render.pictures import clipped, save_figure
from hookrun.stages.sanity.keys import SANITY, VERDICT_SIMILARITY, read_sanity
from hookrun.stages.sanity.verdicts import read_verdicts

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["draw_sanity"]

_DPI = 90


def draw_sanity(f: h5py.File, out_dir: Path) -> list[Path]:
    """The sanity check's pictures of the open file `f`."""
    return _sanity(f, out_dir)


def _sanity(f: h5py.File, out_dir: Path) -> list[Path]:
    methods = walk.group_of(f, SANITY)
    if not methods or layout.read_state(f).completed == 0:
        return []
    layers, _ = read_sanity(f)
    columns = ["original", *layers]
    out = []
    with_maps = {m: d["maps"] for m, d in methods.items() if "maps" in d}
    if with_maps:
        fig, axes = plt.subplots(
            len(with_maps),
            len(columns),
            figsize=(1.1 * len(columns), 1.25 * len(with_maps)),
            squeeze=False,
        )
        for r, (method, ds) in enumerate(with_maps.items()):
            for c, ax in enumerate(axes[r]):
                # |map| clipped at its 99th percentile (Adebayo et al.): min-max scaling
                # left the grid nearly black, a few large values setting the scale.
                image = clipped(ds[0, c], signed=False)
                ax.imshow(image, cmap="gray", vmin=0, vmax=1)
                ax.set_xticks([])
                ax.set_yticks([])
                if r == 0:
                    ax.set_title(columns[c], fontsize=7, rotation=45, ha="left")
                if c == 0:
                    ax.set_ylabel(method, fontsize=7)
        fig.suptitle(f"sanity check, sample #{int(f[layout.SAMPLES_INDEX][0])}", fontsize=9)
        fig.tight_layout()
        out.append(save_figure(fig, out_dir / "sanity_grid.png", _DPI))
    out.append(_similarity_curves(f, methods, columns, out_dir))
    return out


def _similarity_curves(f: h5py.File, methods: dict, columns: list[str], out_dir: Path) -> Path:
    rows = layout.read_state(f).completed
    names = [n for n in ("spearman_abs", "spearman", "ssim")]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    verdicts = read_verdicts(f)
    for ax, name in zip(axes[0], names, strict=True):
        for method, datasets in methods.items():
            if name not in datasets:
                continue
            values = datasets[name][:rows].astype(np.float64)
            verdict = verdicts.get(method)
            label = method + ("" if verdict is None else (" passes" if verdict[0] else " fails"))
            ax.plot(np.median(values, axis=0), marker=".", label=label)
        if name == VERDICT_SIMILARITY:
            ax.axhline(read_sanity(f)[1], color="k", ls="--", lw=0.8)
        ax.set_xticks(range(len(columns)), columns, rotation=90, fontsize=6)
        ax.set(title=f"{name} (median over samples)", ylim=(-0.2, 1.05))
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out_dir / "sanity_similarity.png", _DPI)
