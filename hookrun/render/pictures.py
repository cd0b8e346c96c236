"""Image operations of the pictures: attribution maps clipped at the 99th percentile of
their |values| (a few large values no longer leave the rest black) and overlaid on the photo,
the seed tutorial's gradient normalize, heat-map overlays and feature-map grids, and arrays
→ uint8 RGB."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "MIN_SIDE",
    "save_figure",
    "seed_normalize",
    "clipped",
    "attribution_overlay",
    "OUTLIERS",
    "heat_overlay",
    "feature_grid",
    "to_uint8",
    "display_image",
    "save_whole",
]

# Pictures narrower than this are scaled up (nearest) so an 8x8 digit stays visible.
MIN_SIDE = 128


def seed_normalize(grad: np.ndarray) -> np.ndarray:
    """The seed tutorial's normalize: mean 0.5, std 0.1, clipped to [0, 1]."""
    std = grad.std()
    norm = (grad - grad.mean()) / (std if std > 0 else 1.0)
    return np.clip(norm * 0.1 + 0.5, 0.0, 1.0)


# Percent of a map's pixels, those of the largest |value|, that saturate: Adebayo et al.'s
# 99th percentile. (Captum's visualize_image_attr clips the pixels holding the top 2 % of the
# total |value| instead: one pixel holding more than that still sets the scale alone.)
OUTLIERS = 1.0


def clipped(value: np.ndarray, signed: bool, outliers: float = OUTLIERS) -> np.ndarray:
    """An attribution map (C, H, W) or (H, W) as (H, W) in [-1, 1] (`signed`) or [0, 1]
    (|value|): channels summed, divided by the (100 − outliers)-th percentile of its |values|
    and clipped there — the `outliers` percent of pixels with the largest |value| saturate."""
    v = value.astype(np.float64)
    v = v.sum(0) if v.ndim == 3 else v
    v = v if signed else np.abs(v)
    if not v.size or not np.abs(v).max() > 0:
        return np.zeros_like(v)
    top = float(np.percentile(np.abs(v), 100 - outliers))
    top = top if top > 0 else float(np.abs(v).max())
    return np.clip(v / top, -1.0 if signed else 0.0, 1.0)


def attribution_overlay(photo: np.ndarray | None, value: np.ndarray, signed: bool) -> np.ndarray:
    """(3, H, W) in [0, 1]: the clipped map over the photo shown in grey — signed maps red
    for evidence for the target, blue against (matplotlib's bwr); |maps| in `hot` — each
    pixel's colour as opaque as its |value|. Without a photo, the colours on white."""
    v = clipped(value, signed)
    h, w = v.shape
    if photo is not None and photo.shape[-2:] != (h, w):  # a map at another resolution
        v = (
            F.interpolate(
                torch.from_numpy(v)[None, None].float(), size=photo.shape[-2:], mode="bilinear"
            )[0, 0]
            .numpy()
            .astype(np.float64)
        )
        h, w = v.shape
    if photo is None:
        base = np.ones((3, h, w))
    else:
        grey = photo.mean(0) if photo.shape[0] == 3 else photo[0]
        base = np.repeat((0.25 + 0.5 * grey)[None], 3, axis=0)  # dimmed: the colours read
    if signed:
        colour = np.moveaxis(matplotlib.colormaps["bwr"]((v + 1) / 2)[..., :3], -1, 0)
    else:
        colour = np.moveaxis(matplotlib.colormaps["hot"](0.35 + 0.65 * v)[..., :3], -1, 0)
    alpha = np.abs(v)[None]
    return (1 - alpha) * base + alpha * colour


def to_uint8(image: np.ndarray) -> np.ndarray:
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
    from torchvision.utils import make_grid  # image pictures only

    return make_grid(tiles, nrow=nrow, normalize=True, scale_each=True, pad_value=1.0).numpy()


def display_image(x: np.ndarray, dataset: dict) -> np.ndarray:
    """A model input (C, H, W) as a picture in [0, 1]: the dataset's normalisation undone
    (its `mean` and `std`), else min-max scaled."""
    x = x.astype(np.float32)
    mean, std = dataset.get("mean"), dataset.get("std")
    if x.ndim == 3 and mean and std and len(mean) == x.shape[0]:
        x = x * np.asarray(std)[:, None, None] + np.asarray(mean)[:, None, None]
    elif x.max() > x.min():
        x = (x - x.min()) / (x.max() - x.min())
    return np.clip(x, 0, 1)


def save_figure(fig: Any, target: Path, dpi: int = 110) -> Path:
    """A matplotlib figure to `target` as a PNG, whole (save_whole), its folder made first;
    the figure is closed (pyplot keeps every open one alive)."""
    import matplotlib.pyplot as plt

    target.parent.mkdir(parents=True, exist_ok=True)
    save_whole(target, lambda part: fig.savefig(part, format="png", dpi=dpi))
    plt.close(fig)
    return target


def save_whole(target: Path, save: Callable[[Path], None]) -> None:
    """Write `target` whole or not at all: a run killed while drawing leaves no cut PNG
    that looks like a picture (a rename is atomic; the pictures can be drawn again)."""
    part = target.with_name(f".{target.name}.part")
    save(part)
    os.replace(part, target)
