"""The picture of a generation: the first rows' prompts and, token by token, what the
hooked model wrote, each token coloured by its log probability under the model without the
run's hooks (how fluent the steered text is to the plain model) — where a steering vector
pushes the text somewhere the plain model would not go, the cells turn dark."""

from __future__ import annotations

from pathlib import Path

import h5py
import matplotlib
import numpy as np

from hookrun.io import layout
from hookrun.io.encoding import read_floats
from hookrun.render.pictures import save_figure
from hookrun.render.tokens import token_texts
from hookrun.stages.generate.keys import LOGPROBS_UNHOOKED, MASK, TOKENS

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["render_generation"]

_ROWS = 8  # rows drawn at most
_STEPS = 24  # tokens drawn per row at most
_PROMPT = 40  # characters of each prompt shown


def render_generation(f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
    """images/<experiment>/generation.png; nothing when the file holds no generation."""
    if TOKENS not in f or LOGPROBS_UNHOOKED not in f or rows < 1:
        return []
    shown = min(rows, _ROWS)
    tokens = f[TOKENS][:shown, :_STEPS]
    mask = f[MASK][:shown, :_STEPS].astype(bool)
    fluency = read_floats(f[LOGPROBS_UNHOOKED], slice(0, shown))[:, :_STEPS].astype(np.float64)
    prompts = _prompts(f, shown, config)
    steps = tokens.shape[1]
    fig, ax = plt.subplots(figsize=(2.5 + 0.62 * steps, 0.9 + 0.42 * shown))
    grid = np.where(mask, fluency, np.nan)
    low = min(-8.0, float(np.nanmin(grid, initial=0.0)))
    image = ax.imshow(grid, cmap="viridis", vmin=low, vmax=0.0, aspect="auto")
    for r in range(shown):
        words = token_texts(f, config, tokens[r][mask[r]])
        for s, word in enumerate(words):
            light = (grid[r, s] - low) / -low > 0.55  # dark text on viridis' light end
            colour = "k" if light else "w"
            ax.text(s, r, word[:8], ha="center", va="center", fontsize=6.5, color=colour)
    ax.set_yticks(range(shown), prompts, fontsize=7)
    ax.set_xticks(range(steps), [str(s) for s in range(steps)], fontsize=7)
    ax.set_xlabel("step (generated token)")
    fig.colorbar(image, ax=ax, label="log p under the model without hooks", shrink=0.8)
    ax.set_title("generated text; colour: its fluency to the plain model", fontsize=9)
    fig.tight_layout()
    return [save_figure(fig, out_dir / "generation.png")]


def _prompts(f: h5py.File, shown: int, config: dict) -> list[str]:
    """Each row's prompt as text (its last characters), from /samples/tokens and the mask."""
    ids = f[layout.SAMPLES_TOKENS][:shown]
    mask = f[layout.SAMPLES_MASK][:shown].astype(bool) if layout.SAMPLES_MASK in f else None
    out = []
    for r in range(shown):
        real = ids[r][mask[r]] if mask is not None else ids[r]
        text = "".join(token_texts(f, config, real))
        out.append(("…" + text[-_PROMPT:]) if len(text) > _PROMPT else text)
    return out
