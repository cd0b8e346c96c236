"""Pictures from a finished captures.h5 — never from the run's memory.

    python -m hookrun.render outputs/<date>/<time>/captures.h5 [--out DIR] [--max N]

What is drawn follows what the file holds, for the first `max_samples` rows:
- `/captures/input/grad_output` (saliency, scaled gradients, Guided Backprop) and (C, H, W)
  derived results (integrated gradients, SmoothGrad, occlusion, feature ablation, Guided
  Grad-CAM): with `render_style: clipped` the map with its channels summed, clipped at
  the 99th percentile of its |values| (Adebayo et al.) and overlaid on the photo —
  a gradient by its magnitude, a derived map by its sign (red for the target, blue
  against); with `seed`, the seed's normalize, (g - mean) / std * 0.1 + 0.5 clipped to
  [0, 1]; `auto` (the default): seed for the seeds' gradient experiments (SEED_STYLE),
  clipped otherwise;
- `/derived/<method>/<layer>` maps (Grad-CAM, CAM, RISE): upsampled to the photo and
  overlaid on it as a heat map;
- other (C, H, W) `output` captures (feature maps): one make_grid per layer and sample
  (normalize=True, scale_each=True, nrow=ceil(sqrt(C)));
- token runs: residual norms, token attributions (tokens.py), attention patterns
  (attention.py);
- what a stage stores (the evaluation's curves, the sanity grid, the patching grids, ...):
  drawn by the stage itself (hookrun/stage.py, `Stage.draw`);
and one contact sheet per run with a row per sample.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import matplotlib
import numpy as np
from omegaconf import OmegaConf
from PIL import Image

from hookrun.io import layout, walk
from hookrun.io.encoding import read_floats
from hookrun.render.attention import render_attention
from hookrun.render.pictures import (
    attribution_overlay,
    display_image,
    feature_grid,
    heat_overlay,
    save_whole,
    seed_normalize,
    to_uint8,
)
from hookrun.render.tokens import render_token_attributions, render_tokens
from hookrun.stage import drawn_by_stages, stages

matplotlib.use("Agg")  # files only; no display on clusters
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["render"]

# The seeds' tutorials draw their gradients with the seed's normalize: render_style=auto
# keeps it for these experiments.
SEED_STYLE = ("guided_bp", "guided_grad_cam", "grad_scale")
# What the input gradient is, by experiment (the column title on the contact sheet).
_GRADIENT_TITLES = {
    "guided_bp": "guided backprop",
    "guided_grad_cam": "guided backprop",
    "saliency": "saliency",
    "grad_scale": "gradient, ReLUs scaled",
}


@dataclass
class _Picture:
    kind: str  # the contact sheet's column title
    row: int
    path: Path
    image: np.ndarray = field(repr=False)  # (H, W, 3) uint8


def _photo(f: h5py.File, config: dict, row: int) -> np.ndarray | None:
    # A token file's captured input is its rows of ids, not a photo.
    if layout.INPUT_PHOTO not in f or layout.SAMPLES_TOKENS in f:
        return None
    return display_image(read_floats(f[layout.INPUT_PHOTO], row), config.get("dataset", {}))


def _class_names(config: dict) -> list[str] | None:
    from hookrun.models.sources import class_names, parse_model

    try:
        return class_names(parse_model(config.get("model", {})))
    except Exception:  # an old or foreign file: draw without names rather than fail
        return None


def _row_label(f: h5py.File, row: int, names: list[str] | None) -> str:
    index = int(f[layout.SAMPLES_INDEX][row])
    label = f"#{index}"
    if layout.MODEL_OUTPUT in f:
        logits = read_floats(f[layout.MODEL_OUTPUT], row).reshape(-1).astype(np.float64)
        top = int(logits.argmax())
        name = names[top] if names and top < len(names) else str(top)
        label += f"\n{name}"
    return label


def _natural(name: str) -> list:
    """Sort key that puts features.2 before features.10 (the model's order)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _feature_layers(f: h5py.File, derived_layers: set[str]) -> dict[str, h5py.Dataset]:
    """Layers whose (C, H, W) outputs are drawn as feature-map grids, in the model's order."""
    captured = walk.captures_of(f)
    out = {}
    for layer in sorted(captured, key=_natural):
        ds = captured[layer].get("output")
        # Rows per batch, or windows folded per sample, are not one sample's feature maps.
        maps = ds is not None and ds.ndim == 4 and not layout.rows_note(ds)
        if layer != "input" and layer not in derived_layers and maps:
            out[layer] = ds
    return out


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
    with layout.open_readonly(path) as f:
        state = layout.read_state(f)
        config = OmegaConf.to_container(OmegaConf.create(state.config or "{}"))
        experiment = state.experiment or "run"
        out_dir = Path(out_dir) if out_dir else path.parent / "images" / experiment
        rows = min(state.completed, max_samples)
        derived = {
            f"{m}/{layer}": ds
            for m, group in walk.derived_of(f).items()
            for layer, ds in group.items()
            if not drawn_by_stages(layout.derived_key(m, layer))  # tables, not maps
            and not (layout.SAMPLES_TOKENS in f and layer == "input")  # render_tokens draws
        }
        features = _feature_layers(f, {k.split("/", 1)[1] for k in derived})
        names = _class_names(config)
        labels = [_row_label(f, row, names) for row in range(rows)]
        style = str(config.get("render_style", "auto"))
        seed = style == "seed" or (style == "auto" and experiment in SEED_STYLE)
        for row in range(rows):
            index = int(f[layout.SAMPLES_INDEX][row])
            photo = _photo(f, config, row)

            def attribution(value: np.ndarray, signed: bool = True, photo=photo) -> np.ndarray:
                if seed or value.ndim != 3:  # a vector input (the seed MLP's): not an image
                    return seed_normalize(value)
                return attribution_overlay(photo, value, signed)

            drawn: list[tuple[str, str, np.ndarray]] = []
            if photo is not None:
                drawn.append(("input", "input", photo))
            if layout.INPUT_GRAD in f:
                grad = read_floats(f[layout.INPUT_GRAD], row).astype(np.float32)
                kind = _GRADIENT_TITLES.get(experiment, "input gradient")
                drawn.append((kind, "gradient", attribution(grad, signed=False)))
            for key, ds in derived.items():
                value = ds[row].astype(np.float32)
                if value.ndim < 2:  # a number per sample (a completeness gap): not a picture
                    continue
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
                        (key.replace("/", " @ "), key.replace("/", "_"), attribution(value))
                    )
            for layer, ds in features.items():
                maps = ds[row].astype(np.float32)
                # A function call site's name has a slash (block/gelu.0): not a folder.
                stem = f"features_{layer}".replace("/", "_")
                drawn.append((layer, stem, feature_grid(maps)))
            for kind, stem, image in drawn:
                target = out_dir / f"{index:05d}_{stem}.png"
                out_dir.mkdir(parents=True, exist_ok=True)
                pixels = to_uint8(image)
                save_whole(
                    target, lambda part, p=pixels: Image.fromarray(p).save(part, format="PNG")
                )
                pictures.append(_Picture(kind, row, target, pixels))
        evaluated = render_tokens(f, out_dir, rows, config)
        evaluated += render_token_attributions(f, out_dir, rows, config)
        evaluated += render_attention(f, out_dir, rows, config)
        for stage in stages():
            evaluated += stage.draw(f, out_dir, rows, config)
    if not pictures:  # nothing drawable: no input, gradient, map or feature maps
        return evaluated
    sheet = _contact_sheet(pictures, labels, out_dir / "contact_sheet.png", experiment)
    if tensorboard_dir is not None:
        _to_tensorboard(pictures, tensorboard_dir, plan_text)
    return [p.path for p in pictures] + evaluated + [sheet]


def _wrapped(title: str, width: int = 32) -> str:
    """A column title in lines of at most `width` characters, broken at spaces and after
    dots: a column is 2.6 inches wide, and long module names (ViT's
    encoder.layers.encoder_layer_11.ln_1) ran into the next column's title."""
    return "\n".join(textwrap.wrap(title.replace(".", ". "), width)).replace(". ", ".")


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
                ax.set_title(_wrapped(kind), fontsize=9)
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
    fig.tight_layout(h_pad=1.5)  # rows of square pictures stay apart
    save_whole(target, lambda part: fig.savefig(part, dpi=100, format="png"))
    plt.close(fig)
    return target


def _to_tensorboard(pictures: list[_Picture], log_dir: Path, plan_text: str | None) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(log_dir)) as writer:
        if plan_text:
            writer.add_text("plan", f"```\n{plan_text}\n```")
        for pic in pictures:
            writer.add_image(f"{pic.kind}/{pic.path.stem}", pic.image, dataformats="HWC")
