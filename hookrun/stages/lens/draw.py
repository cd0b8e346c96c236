"""The logit lens picture: for the first rows, the familiar table of blocks × tokens with the
lens's top token (decoded) written in each cell, coloured by its probability; the row's
input tokens label the columns (each cell predicts the token after its column's token)."""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import matplotlib
import numpy as np

from hookrun.io import layout, walk
from hookrun.io.encoding import decoded
from hookrun.render.pictures import save_figure
from hookrun.render.tokens import shown_lengths, token_texts
from hookrun.stages.lens.lens import LOGIT_LENS

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["render_lens"]

_ROWS = 2  # rows drawn, one panel each
_TOKENS = 24  # positions drawn per row at most (the first ones)
_CELL = 8  # characters of a decoded token written in a cell at most
_IDS, _PROBS = (layout.derived_key(LOGIT_LENS, n) for n in ("top_ids", "top_probs"))


def _block_names(f: h5py.File, layers: int) -> list[str]:
    """The captured blocks in the model's order when the file says which they are (as many
    (N, T, D) outputs as the lens has layers), else block 0, 1, ..."""
    tokens = f[_IDS].shape[2]
    found = [
        name
        for name, sites in walk.captures_of(f).items()
        if "output" in sites and sites["output"].ndim == 3 and sites["output"].shape[1] == tokens
    ]
    found.sort(key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])
    return found if len(found) == layers else [f"block {i}" for i in range(layers)]


def _short(text: str) -> str:
    return text if len(text) <= _CELL else text[: _CELL - 1] + "…"


def render_lens(f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
    """`logit_lens.png` for a file with the logit lens's results; [] otherwise."""
    if _IDS not in f or layout.SAMPLES_TOKENS not in f or not rows:
        return []
    ids, probs = f[_IDS], decoded(f[_PROBS])
    layers = ids.shape[1]
    names = _block_names(f, layers)
    shown = min(rows, _ROWS)
    lengths = shown_lengths(f, shown, _TOKENS)
    tokens = f[layout.SAMPLES_TOKENS]
    width = min(tokens.shape[1], _TOKENS)
    fig, axes = plt.subplots(
        shown, 1, figsize=(1.5 + 0.75 * width, 1.0 + (0.45 * layers + 0.9) * shown), squeeze=False
    )
    for row, (ax, length) in enumerate(zip(axes[:, 0], lengths, strict=True)):
        top = ids[row][:, :length, 0]  # (layers, positions): the likeliest token
        p = probs[row][:, :length, 0].astype(np.float32)
        image = ax.imshow(p, aspect="auto", cmap="Blues", vmin=0.0, vmax=1.0)
        words = token_texts(f, config, top.reshape(-1))
        for (layer, pos), word in zip(np.ndindex(top.shape), words, strict=True):
            colour = "white" if p[layer, pos] > 0.6 else "black"
            ax.text(pos, layer, _short(word), ha="center", va="center", fontsize=6, color=colour)
        ax.set_yticks(range(layers), names, fontsize=7)
        ax.set_xticks(
            range(length), token_texts(f, config, tokens[row][:length]), fontsize=7, rotation=90
        )
        ax.set_title(
            f"row {int(f[layout.SAMPLES_INDEX][row])}: the logit lens's top next token after "
            "each block (colour: its probability)",
            fontsize=8,
        )
        fig.colorbar(image, ax=ax, fraction=0.02)
    fig.tight_layout()
    target = out_dir / "logit_lens.png"
    save_figure(fig, target)
    return [target]
