"""The evaluation's pictures, drawn from the finished file like every other picture:

- `<index>_faithfulness_curves.png`: the deletion and insertion curves of one sample, one
  line per attribution;
- `<index>_perturbed_<attribution>.png`: the first samples as deletion, insertion and ROAD
  (MoRF, imputed without its noise) see them at three fractions, recomputed from the stored
  photo (/captures/input/output) and attribution.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import matplotlib
import numpy as np
import torch

from hookrun.io import layout, walk
from hookrun.io.encoding import read_floats
from hookrun.render.pictures import display_image, save_figure
from hookrun.stages.evaluate.config import parse_evaluate
from hookrun.stages.evaluate.curves import baseline_image
from hookrun.stages.evaluate.impute import impute
from hookrun.stages.evaluate.keys import EVALUATE, read_fractions
from hookrun.stages.evaluate.relevance import pixel_ranks, pixel_relevance

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["draw_evaluation"]

# Fractions of pixels the perturbed-image pictures show.
SHOWN = (0.2, 0.5, 0.8)
_PERTURBED_SAMPLES = 2
_DPI = 90


def draw_evaluation(f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
    """Every evaluation picture of the open file `f`, for its first `rows` samples."""
    return [*_curves(f, out_dir, rows), *_perturbed(f, out_dir, rows, config)]


def _curves(f: h5py.File, out_dir: Path, rows: int) -> list[Path]:
    groups = {m: walk.group_of(f, EVALUATE).get(m, {}) for m in ("deletion", "insertion")}
    curves = {m: {k: d for k, d in g.items() if d.ndim == 2} for m, g in groups.items()}
    if not any(curves.values()):
        return []
    out = []
    for row in range(rows):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), squeeze=False)
        for ax, (metric, found) in zip(axes[0], curves.items(), strict=True):
            for attribution, ds in found.items():
                ax.plot(read_fractions(ds), ds[row], label=attribution, marker=".")
            ax.set(title=metric, xlabel="fraction of pixels", ylabel="p(target)", ylim=(0, 1.02))
            if found:
                ax.legend(fontsize=7)
        index = int(f[layout.SAMPLES_INDEX][row])
        fig.suptitle(f"sample #{index}: deletion (lower area is better), insertion (higher)")
        fig.tight_layout()
        out.append(save_figure(fig, out_dir / f"{index:05d}_faithfulness_curves.png", _DPI))
    return out


def _perturbed(f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
    spec = parse_evaluate(config.get("evaluate"))
    if spec is None or layout.INPUT_PHOTO not in f:
        return []
    args = dict(spec.metrics)
    attributions = sorted({a for m in args for a in walk.group_of(f, EVALUATE).get(m, {})})
    attributions = [a for a in attributions if a in f]  # the curves, not their .auc
    out = []
    for row in range(min(rows, _PERTURBED_SAMPLES)):
        photo = read_floats(f[layout.INPUT_PHOTO], slice(row, row + 1))
        x = torch.from_numpy(photo.astype(np.float32))
        h, w = x.shape[-2:]
        index = int(f[layout.SAMPLES_INDEX][row])
        for attribution in attributions:
            value = read_floats(f[attribution], slice(row, row + 1))
            value = torch.from_numpy(value.astype(np.float32))
            ranks = pixel_ranks(pixel_relevance(value, (h, w), spec.config.reduce))[0]
            lines = []
            for metric in ("deletion", "insertion", "road"):
                if metric in args:
                    lines.append(
                        (metric, [_shown(metric, args[metric], x, ranks, r) for r in SHOWN])
                    )
            fig, axes = plt.subplots(len(lines), 3, figsize=(7.5, 2.6 * len(lines)), squeeze=False)
            for axes_row, (metric, images) in zip(axes, lines, strict=True):
                for ax, image, r in zip(axes_row, images, SHOWN, strict=True):
                    ax.imshow(np.moveaxis(display_image(image, config.get("dataset", {})), 0, -1))
                    ax.set_title(f"{metric} {r:.0%}", fontsize=9)
                    ax.axis("off")
            fig.suptitle(f"#{index}: {attribution}", fontsize=9)
            fig.tight_layout()
            stem = attribution.replace("/", "_")
            out.append(save_figure(fig, out_dir / f"{index:05d}_perturbed_{stem}.png", _DPI))
    return out


def _shown(metric: str, args, x: torch.Tensor, ranks: torch.Tensor, r: float) -> np.ndarray:
    """The image `metric` scores when a fraction `r` of the pixels is perturbed."""
    h, w = x.shape[-2:]
    most = (ranks < round(r * h * w)).view(h, w)
    if metric == "road":  # MoRF, without the noise
        return impute(x[0].double().numpy(), most.numpy()).astype(np.float32)
    base = baseline_image(args.baseline, x)[0]
    first, later = (x[0], base) if metric == "deletion" else (base, x[0])
    return torch.where(most, later, first).numpy()
