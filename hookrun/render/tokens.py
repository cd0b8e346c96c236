"""The pictures of a language-model run, for the first rows, the tokens as the axis labels:
the norm of each captured block output at each token (blocks × tokens) — where the residual
stream grows, and which tokens stand out — and each gradient method's attribution per token
(methods × tokens; integrated gradients and AttnLRP summed over the embedding — the sums,
before the picture scales each method to ±1, add up over a row to f(input) − f(baseline)
(AttnLRP's to the target score), up to each one's gap — other methods' L2 norm over it, and
a method of one number per token, attention rollout's, as it is)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
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
from matplotlib.transforms import blended_transform_factory  # noqa: E402

__all__ = ["render_tokens", "render_token_attributions", "shown_lengths", "token_texts"]

_ROWS = 3  # rows drawn, one panel each
_TOKENS = 48  # tokens labelled per row at most (the first ones)


def token_texts(f: h5py.File, config: dict, ids: np.ndarray) -> list[str]:
    """Each id as its text (escaped: a newline shows as \\n): from the file's vocabulary
    (/model/vocabulary, what the run's tokenizer made of each id, a caller's own included),
    else through the tokenizer the run's config names (a file from before the vocabulary was
    stored); the ids themselves where neither can say."""
    stored = layout.read_vocabulary(f, ids)
    if stored is not None:
        return [
            str(int(i)) if t is None else repr(t)[1:-1] for i, t in zip(ids, stored, strict=True)
        ]
    tokenizer = _tokenizer(json.dumps(config.get("model", {}), sort_keys=True, default=str))
    try:
        return [repr(tokenizer.decode([int(i)]))[1:-1] for i in ids]
    except Exception:  # drawing is a convenience: never fail a finished run over labels
        return [str(int(i)) for i in ids]


def shown_lengths(f: h5py.File, rows: int, most: int) -> list[int]:
    """The real tokens of each of the first `rows` rows drawn (padding left out), at most
    `most` each (the first ones)."""
    ids = f[layout.SAMPLES_TOKENS]
    mask = f[layout.SAMPLES_MASK][:rows] if layout.SAMPLES_MASK in f else None
    whole = [int(m.sum()) for m in mask] if mask is not None else [ids.shape[1]] * rows
    return [min(n, most) for n in whole]


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
    blocks = _blocks(f, f[layout.SAMPLES_TOKENS].shape[1])
    if not blocks:
        return []

    def norms(row: int, length: int) -> np.ndarray:
        return np.stack(
            [np.linalg.norm(read_floats(ds, row)[:length], axis=-1) for ds in blocks.values()]
        )

    said = "norm of each block's output per token"
    picture = _Panels(list(blocks), norms, said, {"cmap": "viridis"})
    return [picture.draw(f, out_dir / "residual_norms.png", rows, config)]


def render_token_attributions(f: h5py.File, out_dir: Path, rows: int, config: dict) -> list:
    """`token_attributions.png` for a token file with derived input attributions (N, T, D),
    or one number per token (N, T); [] otherwise."""
    if layout.SAMPLES_TOKENS not in f or not rows:
        return []
    found = {
        method: group["input"]
        for method, group in walk.derived_of(f).items()
        if "input" in group and group["input"].ndim in (2, 3)
    }
    if not found:
        return []

    def per_token(row: int, length: int) -> np.ndarray:
        cells = []
        for method, ds in found.items():
            value = read_floats(ds, row)[:length]
            if value.ndim == 1:  # one number per token already (attention rollout)
                cells.append(value.astype(np.float64))
                continue
            summed = method in ("integrated_gradients", "lrp")  # sums that conserve
            cells.append(value.sum(-1) if summed else np.linalg.norm(value, axis=-1))
        # Each method on its own scale (its largest |value| = 1): their units differ.
        return np.stack([c / (float(np.abs(c).max()) or 1.0) for c in cells])

    said = "attribution per token, each method scaled to its largest |value|"
    colours = {"cmap": "RdBu_r", "vmin": -1, "vmax": 1}
    picture = _Panels(list(found), per_token, said, colours)
    return [picture.draw(f, out_dir / "token_attributions.png", rows, config)]


def _label_tokens(ax: Any, texts: list[str]) -> None:
    """Each token's text under its column. Plain text artists, not tick labels: a tick is
    five artists, and ~150 of them were most of the picture's cost (0.5 s → 0.3 s here);
    `parse_math=False`: a token such as `$x$` is shown as written, not as math."""
    ax.set_xticks([])
    below = blended_transform_factory(ax.transData, ax.transAxes)
    for column, text in enumerate(texts):
        ax.text(
            column,
            -0.04,
            text,
            transform=below,
            rotation=90,
            fontsize=6,
            ha="center",
            va="top",
            parse_math=False,
        )


@dataclass(frozen=True)
class _Panels:
    """A picture of one panel per row of the first rows: `cells(row, length)` the (names,
    tokens) grid of that row's first `length` real tokens, the tokens as the x labels."""

    names: list[str]
    cells: Callable[[int, int], np.ndarray]
    title: str
    colours: dict[str, Any]

    def draw(self, f: h5py.File, target: Path, rows: int, config: dict) -> Path:
        ids = f[layout.SAMPLES_TOKENS]
        lengths = shown_lengths(f, min(rows, _ROWS), _TOKENS)
        # Each panel its rows and the token labels under them (an inch): one method's single
        # row was squeezed to a line by its labels.
        height = 0.6 + (0.45 * len(self.names) + 1.0) * len(lengths)
        fig, axes = plt.subplots(len(lengths), 1, figsize=(12, height), squeeze=False)
        for row, (ax, length) in enumerate(zip(axes[:, 0], lengths, strict=True)):
            image = ax.imshow(self.cells(row, length), aspect="auto", **self.colours)
            ax.set_yticks(range(len(self.names)), self.names, fontsize=7)
            _label_tokens(ax, token_texts(f, config, ids[row][:length]))
            index = int(f[layout.SAMPLES_INDEX][row])
            ax.set_title(f"row {index}: {self.title}", fontsize=8)
            fig.colorbar(image, ax=ax, fraction=0.02)
        fig.tight_layout()
        return save_figure(fig, target)
