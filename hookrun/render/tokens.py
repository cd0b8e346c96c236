"""The pictures of a language-model run, for the first rows, the tokens as the axis labels:
the norm of each captured block output at each token (blocks × tokens) — where the residual
stream grows, and which tokens stand out — and each gradient method's attribution per token
(methods × tokens; integrated gradients summed over the embedding, so a row's cells add up
to f(input) − f(baseline); other methods' L2 norm over it)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import h5py
import matplotlib
import numpy as np

from hookrun.io import layout, walk
from hookrun.io.encoding import read_floats
from hookrun.render.pictures import save_figure

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["render_tokens", "render_token_attributions"]

_ROWS = 3  # rows drawn, one panel each
_TOKENS = 48  # tokens labelled per row at most (the first ones)


def _token_texts(config: dict, ids: np.ndarray) -> list[str]:
    """Each id as its text through the run's tokenizer; the ids themselves where it cannot
    be loaded (a file read on another machine)."""
    tokenizer = _tokenizer(json.dumps(config.get("model", {}), sort_keys=True, default=str))
    try:
        return [repr(tokenizer.decode([int(i)]))[1:-1] for i in ids]
    except Exception:  # drawing is a convenience: never fail a finished run over labels
        return [str(int(i)) for i in ids]


@functools.lru_cache(maxsize=4)
def _tokenizer(model_json: str) -> Any:
    """The tokenizer of a run's `model` config (as JSON), loaded once for all its labels
    (a load is a tenth of a second or more); None where it cannot be loaded."""
    try:
        from hookrun.models.hf import load_tokenizer
        from hookrun.models.sources import parse_model

        return load_tokenizer(parse_model(json.loads(model_json)))
    except Exception:  # drawing is a convenience: never fail a finished run over labels
        return None


def _blocks(f: h5py.File, tokens: int) -> dict[str, h5py.Dataset]:
    """Captured outputs with a token axis (N, T, D), in model order."""
    out = {}
    for layer, sites in walk.captures_of(f).items():
        ds = sites.get("output")
        if ds is not None and ds.ndim == 3 and ds.shape[1] == tokens and not layout.rows_note(ds):
            out[layer] = ds
    return out


def render_tokens(f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
    """`residual_norms.png` for a file of token rows with block outputs; [] otherwise."""
    if layout.SAMPLES_TOKENS not in f or not rows:
        return []
    ids = f[layout.SAMPLES_TOKENS]
    blocks = _blocks(f, ids.shape[1])
    if not blocks:
        return []
    shown = min(rows, _ROWS)
    mask = f[layout.SAMPLES_MASK][:shown] if layout.SAMPLES_MASK in f else None
    fig, axes = plt.subplots(
        shown, 1, figsize=(12, 1.2 + 0.45 * len(blocks) * shown), squeeze=False
    )
    for row, ax in enumerate(axes[:, 0]):
        length = int(mask[row].sum()) if mask is not None else ids.shape[1]
        length = min(length, _TOKENS)
        norms = np.stack(
            [np.linalg.norm(read_floats(ds, row)[:length], axis=-1) for ds in blocks.values()]
        )
        image = ax.imshow(norms, aspect="auto", cmap="viridis")
        ax.set_yticks(range(len(blocks)), list(blocks), fontsize=7)
        ax.set_xticks(
            range(length), _token_texts(config, ids[row][:length]), fontsize=6, rotation=90
        )
        ax.set_title(
            f"row {int(f[layout.SAMPLES_INDEX][row])}: norm of each block's output per token",
            fontsize=8,
        )
        fig.colorbar(image, ax=ax, fraction=0.02)
    fig.tight_layout()
    target = out_dir / "residual_norms.png"
    save_figure(fig, target)
    return [target]


def render_token_attributions(f: h5py.File, out_dir: Path, rows: int, config: dict) -> list:
    """`token_attributions.png` for a token file with derived input attributions (N, T, D);
    [] otherwise."""
    if layout.SAMPLES_TOKENS not in f or not rows:
        return []
    found = {
        method: group["input"]
        for method, group in walk.derived_of(f).items()
        if "input" in group and group["input"].ndim == 3
    }
    if not found:
        return []
    ids = f[layout.SAMPLES_TOKENS]
    shown = min(rows, _ROWS)
    mask = f[layout.SAMPLES_MASK][:shown] if layout.SAMPLES_MASK in f else None
    fig, axes = plt.subplots(shown, 1, figsize=(12, 1.2 + 0.45 * len(found) * shown))
    for row, ax in enumerate(np.atleast_1d(axes)):
        length = min(int(mask[row].sum()) if mask is not None else ids.shape[1], _TOKENS)
        cells = []
        for method, ds in found.items():
            value = read_floats(ds, row)[:length]
            cells.append(
                value.sum(-1)
                if method == "integrated_gradients"
                else np.linalg.norm(value, axis=-1)
            )
        # Each method on its own scale (its largest |value| = 1): their units differ.
        grid = np.stack([c / (float(np.abs(c).max()) or 1.0) for c in cells])
        image = ax.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1)
        ax.set_yticks(range(len(found)), list(found), fontsize=7)
        ax.set_xticks(
            range(length), _token_texts(config, ids[row][:length]), fontsize=6, rotation=90
        )
        ax.set_title(
            f"row {int(f[layout.SAMPLES_INDEX][row])}: attribution per token, each method "
            "scaled to its largest |value|",
            fontsize=8,
        )
        fig.colorbar(image, ax=ax, fraction=0.02)
    fig.tight_layout()
    target = out_dir / "token_attributions.png"
    save_figure(fig, target)
    return [target]
