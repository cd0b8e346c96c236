"""The pictures of attention patterns (`at: pattern`): per captured attention module, a grid
of its heads (columns) for the first rows (rows of the grid), each the query × key
probabilities over the row's real tokens, the tokens as the axis labels."""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import matplotlib
import numpy as np

from hookrun.io import layout, walk
from hookrun.io.encoding import read_floats
from hookrun.render.pictures import save_figure
from hookrun.render.tokens import shown_lengths, token_texts

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["render_attention"]

_ROWS = 2  # rows drawn per module
_HEADS = 12  # heads drawn per module at most (the first ones)
_TOKENS = 24  # tokens labelled at most (the first ones)


def _natural(name: str) -> list:
    """`transformer.h.10` after `transformer.h.2`."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def render_attention(f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
    """`attention_<module>.png` for each captured pattern of a token-data file; [] if none."""
    if layout.SAMPLES_TOKENS not in f or not rows:
        return []
    patterns = {
        layer: sites["pattern"]
        for layer, sites in walk.captures_of(f).items()
        if "pattern" in sites and sites["pattern"].ndim == 4
    }
    if not patterns:
        return []
    ids = f[layout.SAMPLES_TOKENS]
    shown = min(rows, _ROWS)
    lengths = shown_lengths(f, shown, _TOKENS)
    texts = [token_texts(f, config, ids[r][: lengths[r]]) for r in range(shown)]
    written = []
    for layer in sorted(patterns, key=_natural):
        ds = patterns[layer]
        heads = min(ds.shape[1], _HEADS)
        fig, axes = plt.subplots(
            shown, heads, figsize=(2.2 * heads + 0.5, 2.4 * shown + 0.4), squeeze=False
        )
        for r in range(shown):
            probs = read_floats(ds, r).astype(np.float32)
            n = lengths[r]
            for h in range(heads):
                ax = axes[r, h]
                ax.imshow(probs[h, :n, :n], cmap="viridis", vmin=0.0, vmax=1.0)
                ax.set_xticks(range(n), texts[r], fontsize=4, rotation=90)
                ax.set_yticks(range(n), texts[r], fontsize=4)
                ax.set_title(f"row {int(f[layout.SAMPLES_INDEX][r])}, head {h}", fontsize=6)
        fig.suptitle(f"{layer}: attention (query ↓, key →)", fontsize=8)
        fig.tight_layout()
        target = out_dir / f"attention_{layer.replace('/', '_')}.png"
        save_figure(fig, target)
        written.append(target)
    return written
