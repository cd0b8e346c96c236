"""Pictures from a finished captures.h5 — never from the run's memory.

    python -m hookrun.render outputs/<date>/<time>/captures.h5 [--out DIR] [--max N]

What is drawn follows what the file holds, for the first `max_samples` rows:
- `/captures/input/grad_output` (Guided Backprop, saliency, scaled gradients): the seed's
  normalize, (g - mean) / std * 0.1 + 0.5 clipped to [0, 1];
- `/derived/<method>/<layer>` maps (Grad-CAM, CAM): upsampled to the photo and overlaid on it
  as a heat map; (C, H, W) results (Guided Grad-CAM) like gradients;
- other (C, H, W) `output` captures (feature maps): one make_grid per layer and sample
  (normalize=True, scale_each=True, nrow=ceil(sqrt(C)));
and one contact sheet per run with a row per sample.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from PIL import Image
from torchvision.utils import make_grid

from hookrun.sinks.hdf5 import open_readonly

matplotlib.use("Agg")  # files only; no display on clusters
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["seed_normalize", "heat_overlay", "feature_grid", "render", "main"]

# Pictures narrower than this are scaled up (nearest) so an 8x8 digit stays visible.
MIN_SIDE = 128

# What the input gradient is, by experiment (the column title on the contact sheet).
_GRADIENT_TITLES = {
    "guided_bp": "guided backprop",
    "guided_grad_cam": "guided backprop",
    "saliency": "saliency",
    "grad_scale": "gradient, ReLUs scaled",
}


def seed_normalize(grad: np.ndarray) -> np.ndarray:
    """The seed tutorial's normalize: mean 0.5, std 0.1, clipped to [0, 1]."""
    std = grad.std()
    norm = (grad - grad.mean()) / (std if std > 0 else 1.0)
    return np.clip(norm * 0.1 + 0.5, 0.0, 1.0)


def _to_uint8(image: np.ndarray) -> np.ndarray:
    """(C, H, W) or (H, W) floats in [0, 1] → (H, W, 3) uint8, scaled up when tiny."""
    if image.ndim == 3:
        image = image[0] if image.shape[0] == 1 else np.moveaxis(image[:3], 0, -1)
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=-1)
    out = (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
    factor = math.ceil(MIN_SIDE / min(out.shape[:2]))
    if factor > 1:
        out = np.kron(out, np.ones((factor, factor, 1), dtype=np.uint8))
    return out


def heat_overlay(photo: np.ndarray, heat: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """`heat` (h, w), min-max scaled and upsampled (bilinear) to `photo` (C, H, W) in
    [0, 1], blended with the jet colour map. Returns (C=3, H, W) in [0, 1]."""
    h, w = photo.shape[-2:]
    up = F.interpolate(
        torch.from_numpy(heat.astype(np.float32))[None, None], size=(h, w), mode="bilinear"
    )[0, 0].numpy()
    span = up.max() - up.min()
    up = (up - up.min()) / span if span > 0 else np.zeros_like(up)
    colour = np.moveaxis(matplotlib.colormaps["jet"](up)[..., :3], -1, 0)
    base = photo if photo.shape[0] == 3 else np.repeat(photo[:1], 3, axis=0)
    return (1 - alpha) * base + alpha * colour


def feature_grid(maps: np.ndarray) -> np.ndarray:
    """(C, h, w) feature maps → one grid image (3, H, W) in [0, 1], each map scaled alone."""
    tiles = torch.from_numpy(maps.astype(np.float32))[:, None]
    nrow = math.ceil(math.sqrt(len(tiles)))
    return make_grid(tiles, nrow=nrow, normalize=True, scale_each=True, pad_value=1.0).numpy()


@dataclass
class _Picture:
    kind: str  # the contact sheet's column title
    row: int
    path: Path
    image: np.ndarray = field(repr=False)  # (H, W, 3) uint8


def _photo(f: h5py.File, config: dict, row: int) -> np.ndarray | None:
    if "captures/input/output" not in f:
        return None
    x = f["captures/input/output"][row].astype(np.float32)
    dataset = config.get("dataset", {})
    mean, std = dataset.get("mean"), dataset.get("std")
    if x.ndim == 3 and mean and std and len(mean) == x.shape[0]:
        x = x * np.asarray(std)[:, None, None] + np.asarray(mean)[:, None, None]
    elif x.max() > x.min():
        x = (x - x.min()) / (x.max() - x.min())
    return np.clip(x, 0, 1)


def _class_names(config: dict) -> list[str] | None:
    from hookrun.config import ModelConfig, parse_typed
    from hookrun.models import class_names

    try:
        return class_names(parse_typed(config.get("model", {}), ModelConfig, "model"))
    except Exception:  # an old or foreign file: draw without names rather than fail
        return None


def _row_label(f: h5py.File, row: int, names: list[str] | None) -> str:
    index = int(f["samples/index"][row])
    label = f"#{index}"
    if "model/output" in f:
        logits = f["model/output"][row].reshape(-1).astype(np.float64)
        top = int(logits.argmax())
        name = names[top] if names and top < len(names) else str(top)
        label += f"\n{name}"
    return label


def _natural(name: str) -> list:
    """Sort key that puts features.2 before features.10 (the model's order)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _feature_layers(f: h5py.File, derived_layers: set[str]) -> list[str]:
    if "captures" not in f:
        return []
    layers = []
    for layer in sorted(f["captures"], key=_natural):
        group = f["captures"][layer]
        ds = group.get("output")
        if layer != "input" and layer not in derived_layers and ds is not None and ds.ndim == 4:
            layers.append(layer)
    return layers


def render(
    path: Path,
    out_dir: Path | None = None,
    max_samples: int = 16,
    tensorboard_dir: Path | None = None,
    plan_text: str | None = None,
) -> list[Path]:
    """Draw the pictures of one captures.h5; returns the files written, contact sheet last."""
    path = Path(path)
    pictures: list[_Picture] = []
    with open_readonly(path) as f:
        config = OmegaConf.to_container(OmegaConf.create(str(f.attrs.get("config", "{}"))))
        experiment = str(f.attrs.get("experiment", "")) or "run"
        out_dir = Path(out_dir) if out_dir else path.parent / "images" / experiment
        rows = min(int(f.attrs.get("completed", len(f["samples/index"]))), max_samples)
        derived = {
            f"{m}/{layer}": f[f"derived/{m}/{layer}"]
            for m in f.get("derived", {})
            for layer in f[f"derived/{m}"]
        }
        features = _feature_layers(f, {k.split("/", 1)[1] for k in derived})
        names = _class_names(config)
        labels = [_row_label(f, row, names) for row in range(rows)]
        for row in range(rows):
            index = int(f["samples/index"][row])
            photo = _photo(f, config, row)
            drawn: list[tuple[str, str, np.ndarray]] = []
            if photo is not None:
                drawn.append(("input", "input", photo))
            if "captures/input/grad_output" in f:
                grad = f["captures/input/grad_output"][row].astype(np.float32)
                kind = _GRADIENT_TITLES.get(experiment, "input gradient")
                drawn.append((kind, "gradient", seed_normalize(grad)))
            for key, ds in derived.items():
                value = ds[row].astype(np.float32)
                if value.ndim == 2 and photo is not None:
                    drawn.append(
                        (key.replace("/", " @ "), key.replace("/", "_"), heat_overlay(photo, value))
                    )
                elif value.ndim == 2:
                    drawn.append(
                        (
                            key,
                            key.replace("/", "_"),
                            heat_overlay(np.zeros((3,) + value.shape), value),
                        )
                    )
                else:
                    drawn.append(
                        (key.replace("/", " @ "), key.replace("/", "_"), seed_normalize(value))
                    )
            for layer in features:
                maps = f[f"captures/{layer}/output"][row].astype(np.float32)
                drawn.append((layer, f"features_{layer}", feature_grid(maps)))
            for kind, stem, image in drawn:
                target = out_dir / f"{index:05d}_{stem}.png"
                out_dir.mkdir(parents=True, exist_ok=True)
                pixels = _to_uint8(image)
                Image.fromarray(pixels).save(target)
                pictures.append(_Picture(kind, row, target, pixels))
    if not pictures:  # nothing drawable: no input, gradient, map or feature maps
        return []
    sheet = _contact_sheet(pictures, labels, out_dir / "contact_sheet.png", experiment)
    if tensorboard_dir is not None:
        _to_tensorboard(pictures, tensorboard_dir, plan_text)
    return [p.path for p in pictures] + [sheet]


def _contact_sheet(pictures: list[_Picture], labels: list[str], target: Path, title: str) -> Path:
    """One figure: a row per sample, a column per picture kind (at most 6 columns)."""
    kinds = list(dict.fromkeys(p.kind for p in pictures))
    if len(kinds) > 6:  # many feature layers: the photo, then 5 layers spread over the net
        picks = np.linspace(1, len(kinds) - 1, 5).round().astype(int)
        kinds = [kinds[0], *[kinds[i] for i in picks]]
    rows = max(1, len(labels))
    fig, axes = plt.subplots(
        rows, max(1, len(kinds)), figsize=(2.6 * max(1, len(kinds)), 2.8 * rows), squeeze=False
    )
    by_cell = {(p.row, p.kind): p for p in pictures}
    for r in range(rows):
        for c, kind in enumerate(kinds):
            ax = axes[r][c]
            ax.axis("off")
            pic = by_cell.get((r, kind))
            if pic is not None:
                ax.imshow(pic.image)
            if r == 0:
                ax.set_title(kind, fontsize=9)
            if c == 0 and r < len(labels):
                ax.text(
                    -0.05,
                    0.5,
                    labels[r],
                    transform=ax.transAxes,
                    ha="right",
                    va="center",
                    fontsize=8,
                )
    fig.suptitle(title.replace("_", " "))
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def _to_tensorboard(pictures: list[_Picture], log_dir: Path, plan_text: str | None) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(log_dir)) as writer:
        if plan_text:
            writer.add_text("plan", f"```\n{plan_text}\n```")
        for pic in pictures:
            writer.add_image(f"{pic.kind}/{pic.path.stem}", pic.image, dataformats="HWC")


def main(argv: list[str] | None = None) -> None:
    """`python -m hookrun.render captures.h5`: re-draw the pictures of an earlier run."""
    parser = argparse.ArgumentParser(prog="python -m hookrun.render", description=main.__doc__)
    parser.add_argument("path", type=Path, help="a captures.h5 written by hookrun")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the pictures (default: <run dir>/images/<experiment>)",
    )
    parser.add_argument("--max", type=int, default=16, help="samples to draw (first rows)")
    args = parser.parse_args(argv)
    if not args.path.is_file():
        parser.error(f"{args.path}: no such file")
    written = render(args.path, args.out, args.max)
    print(f"{len(written)} pictures in {written[-1].parent}")


if __name__ == "__main__":
    main()
