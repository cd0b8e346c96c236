"""The pictures of what the perturbation methods perturbed, from the file alone: each row's
segments (feature ablation, KernelSHAP) as their boundaries over the photo, and the first
of each row's RISE masks made again from their stored cells and shifts (rise.masks_from).
They are no maps: the pictures of every derived map leave them out (DeriveStage.draws)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import torch

from hookrun.io import layout, walk
from hookrun.io.encoding import read_floats
from hookrun.render.pictures import display_image, feature_grid, save_whole, to_uint8
from hookrun.stages.derive.rise import CELLS_KEY, SHIFTS_KEY, masks_from
from hookrun.stages.derive.segments import SEGMENTS_SUFFIX

__all__ = ["draw_perturbations", "MASKS_DRAWN"]

MASKS_DRAWN = 16  # RISE masks drawn per row, the first ones


def _save(image: np.ndarray, target: Path) -> Path:
    """(3, H, W) in [0, 1] as a PNG, whole."""
    from PIL import Image

    target.parent.mkdir(parents=True, exist_ok=True)
    pixels = to_uint8(image)
    save_whole(target, lambda part: Image.fromarray(pixels).save(part, format="PNG"))
    return target


def _segment_pictures(f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
    from skimage.segmentation import mark_boundaries

    out = []
    for method, group in walk.derived_of(f).items():
        found = [k for k in group if k.endswith(SEGMENTS_SUFFIX)]
        for key in found:
            labels = f[layout.derived_key(method, key)]
            for row in range(min(rows, labels.shape[0])):
                if layout.INPUT_PHOTO in f:
                    photo = read_floats(f[layout.INPUT_PHOTO], row)
                    base = display_image(photo, config.get("dataset", {}))
                else:
                    base = np.full((3, *labels.shape[1:]), 0.5)
                base = base if base.shape[0] == 3 else np.repeat(base[:1], 3, axis=0)
                drawn = mark_boundaries(np.moveaxis(base, 0, -1), labels[row], color=(1, 1, 0))
                index = int(f[layout.SAMPLES_INDEX][row])
                target = out_dir / f"{index:05d}_{method}_segments.png"
                out.append(_save(np.moveaxis(drawn, -1, 0), target))
    return out


def _mask_pictures(f: h5py.File, out_dir: Path, rows: int) -> list[Path]:
    if CELLS_KEY not in f or layout.derived_key("rise", "input") not in f:
        return []
    size = tuple(f[layout.derived_key("rise", "input")].shape[1:])
    out = []
    for row in range(min(rows, f[CELLS_KEY].shape[0])):
        cells = torch.from_numpy(f[CELLS_KEY][row, :MASKS_DRAWN].astype(bool))
        shifts = torch.from_numpy(f[SHIFTS_KEY][row, :MASKS_DRAWN])
        masks = masks_from(cells, shifts, size).numpy()
        index = int(f[layout.SAMPLES_INDEX][row])
        out.append(_save(feature_grid(masks), out_dir / f"{index:05d}_rise_masks.png"))
    return out


def draw_perturbations(f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
    """The segments' and the RISE masks' pictures of the file's first `rows` rows."""
    return [*_segment_pictures(f, out_dir, rows, config), *_mask_pictures(f, out_dir, rows)]
