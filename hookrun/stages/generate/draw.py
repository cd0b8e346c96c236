"""The picture of a generation: the first rows' prompts and, token by token, what the
hooked model wrote, each token coloured by its log probability under the model without the
run's hooks (how fluent the steered text is to the plain model) — where a steering vector
pushes the text somewhere the plain model would not go, the cells turn dark. With
generate.fluency=false the colour is the hooked model's own log probability. The colour
bar lies under the grid, where a picture of one or two rows has room for its label."""

from __future__ import annotations

from pathlib import Path

import h5py
import matplotlib
import numpy as np

from hookrun.io import layout
from hookrun.io.encoding import read_floats
from hookrun.render.pictures import save_figure
from hookrun.render.tokens import token_texts
from hookrun.stages.generate.keys import LOGPROBS, LOGPROBS_UNHOOKED, MASK, TOKENS

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["render_generation"]

_ROWS = 8  # rows drawn at most
_STEPS = 24  # tokens drawn per row at most
_PROMPT = 40  # characters of each prompt shown


def render_generation(f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
    """images/<experiment>/generation.png; nothing when the file holds no generation."""
    if TOKENS not in f or rows < 1:
        return []
    shown = min(rows, _ROWS)
    tokens = f[TOKENS][:shown, :_STEPS]
    mask = f[MASK][:shown, :_STEPS].astype(bool)
    plain = LOGPROBS_UNHOOKED in f
    scored = read_floats(f[LOGPROBS_UNHOOKED if plain else LOGPROBS], slice(0, shown))
    prompts = _prompts(f, shown, config)
    steps = tokens.shape[1]
    # The rows' own height, then a slot of fixed height for the colour bar: the title, the
    # step axis and the bar's label keep their room whatever the number of rows.
    fig, (ax, slot) = plt.subplots(
        2,
        1,
        figsize=(2.5 + 0.62 * steps, 1.9 + 0.42 * shown),
        height_ratios=[0.42 * shown, 0.12],
    )
    fig.set_layout_engine("constrained", w_pad=0.1, h_pad=0.08)  # a margin all round
    grid = np.where(mask, scored[:, :_STEPS].astype(np.float64), np.nan)
    low = min(-8.0, float(np.nanmin(grid, initial=0.0)))
    image = ax.imshow(grid, cmap="viridis", vmin=low, vmax=0.0, aspect="auto")
    for r in range(shown):
        words = token_texts(f, config, tokens[r][mask[r]])
        for s, word in enumerate(words):
            light = (grid[r, s] - low) / -low > 0.55  # dark text on viridis' light end
            colour = "k" if light else "w"
            cell = ax.text(s, r, word[:8], ha="center", va="center", fontsize=6.5, color=colour)
            cell.set_in_layout(False)  # inside its cell: the layout need not measure it
    ax.set_yticks(range(shown), prompts, fontsize=7)
    ax.set_xticks(range(steps), [str(s) for s in range(steps)], fontsize=7)
    ax.set_xlabel("step (generated token)")
    under = "the model without hooks" if plain else "the hooked model (generate.fluency=false)"
    slot.set_axis_off()
    bar = fig.colorbar(image, cax=slot.inset_axes((0.25, 0.0, 0.5, 1.0)), orientation="horizontal")
    bar.set_label(f"log p under {under}", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    said = "its fluency to the plain model" if plain else "its log probability, hooked"
    ax.set_title(f"generated text; colour: {said}", fontsize=9)
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
