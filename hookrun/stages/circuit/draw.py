"""The pictures of an edge attribution run: the circuit of the largest edges drawn as a
graph (the layers bottom to top, the embeddings, each head, each MLP and the logits as
nodes, the query, key and value a head reads as small squares below it marked q, k, v; an
edge's width its mean |score|, its colour its sign), and the faithfulness of the
circuits of each size circuit.k (the share of clean − corrupted they keep)."""

from __future__ import annotations

import warnings
from pathlib import Path

import h5py
import matplotlib
import numpy as np

from hookrun.io import layout
from hookrun.io.encoding import read_floats
from hookrun.render.pictures import save_figure
from hookrun.stages.circuit.keys import EDGES, FAITHFULNESS, RECEIVERS, SENDERS

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["render_circuit"]

_DRAWN = 25  # edges drawn at most


def _names(values) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def _place(name: str, heads: int, kv_heads: int) -> tuple[float, float]:
    """(x, y) of a node: embed at the bottom, layer l's heads in a row at 2l + 1 and its MLP
    at 2l + 2, the logits on top; a head's query, key and value just below it (a shared
    key/value head's below the middle of the query heads that read it)."""
    middle = (heads - 1) / 2
    if name == "embed":
        return (middle, 0.0)
    if name == "logits":
        return (middle, 1e9)
    parts = name.split(".")
    layer = int(parts[0][1:])
    if len(parts) == 3:  # a<layer>.h<head>.q, a<layer>.kv<group>.k, ...
        group = heads // max(kv_heads, 1)
        x = (
            float(parts[1][1:])
            if parts[1].startswith("h")
            else int(parts[1][2:]) * group + (group - 1) / 2
        )
        return (x + {"q": -0.22, "k": 0.0, "v": 0.22}[parts[2]], 2.0 * layer + 0.7)
    if name.startswith("a") and len(parts) == 2:  # a<layer>.h<head>: the head itself
        return (float(parts[1][1:]), 2.0 * layer + 1)
    if name.startswith("a"):  # a<layer>: a file from before receivers were per head
        return (-1.0, 2.0 * layer + 0.5)
    return (middle, 2.0 * layer + 2)


def render_circuit(f: h5py.File, out_dir: Path, rows: int) -> list[Path]:
    if EDGES not in f or rows < 1:
        return []
    ds = f[EDGES]
    senders, receivers = _names(layout.attr(ds, SENDERS)), _names(layout.attr(ds, RECEIVERS))
    heads = sum(1 for s in senders if s.startswith("a0.h"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(read_floats(ds, slice(0, rows)).astype(np.float64), axis=0)
    flat = np.argsort(-np.nan_to_num(np.abs(mean), nan=-1.0), axis=None)[:_DRAWN]
    chosen = [np.unravel_index(i, mean.shape) for i in flat if np.isfinite(mean.flat[i])]
    top = max((abs(mean[s, r]) for s, r in chosen), default=1.0) or 1.0
    layers = sum(1 for r in receivers if r.startswith("m"))
    kv_heads = int(layout.attr(ds, "key_value_heads") or heads)
    fig, ax = plt.subplots(figsize=(2.5 + 0.9 * heads, 2.5 + 1.1 * layers))
    logits_y = 2.0 * layers + 1
    spot = {n: _place(n, heads, kv_heads) for n in senders + receivers}
    spot["logits"] = ((heads - 1) / 2, logits_y)
    for s, r in chosen:
        (x0, y0), (x1, y1) = spot[senders[s]], spot[receivers[r]]
        colour = "tab:red" if mean[s, r] > 0 else "tab:blue"
        ax.plot(
            [x0, x1], [y0, y1], color=colour, linewidth=0.5 + 4 * abs(mean[s, r]) / top, alpha=0.7
        )
    for name in senders + ["logits"]:
        x, y = spot[name]
        ax.scatter([x], [y], s=60, color="0.2", zorder=3)
        ax.annotate(name, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    for r in sorted({r for _, r in chosen}):  # the heads' inputs the drawn edges reach
        name = receivers[r]
        if name.count(".") == 2:
            x, y = spot[name]
            if ".h" in name:  # a head's own input: tied to the head above it
                hx, hy = spot[name.rsplit(".", 1)[0]]
                ax.plot([x, hx], [y, hy], color="0.6", linewidth=0.6, zorder=2)
            ax.scatter([x], [y], s=30, marker="s", facecolors="white", edgecolors="0.2", zorder=3)
            ax.annotate(name.split(".")[2], (x, y), fontsize=6, ha="center", va="center", zorder=4)
    ax.set_axis_off()
    ax.set_title(
        f"the {len(chosen)} edges of largest mean |{layout.attr(ds, 'method')} score| "
        "(red: toward the clean answer)",
        fontsize=8,
    )
    drawn = [save_figure(fig, out_dir / "circuit.png")]
    if FAITHFULNESS in f:
        sizes = np.asarray(layout.attr(f[FAITHFULNESS], "k"))
        shares = f[FAITHFULNESS][()]
        order = np.argsort(sizes)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(sizes[order], shares[order], marker="o")
        ax.axhline(1.0, color="0.6", linewidth=0.8)
        ax.axhline(0.0, color="0.6", linewidth=0.8)
        ax.set_xlabel("edges kept (the largest mean |score|)")
        ax.set_ylabel("share of clean - corrupted kept")
        ax.set_title("circuit faithfulness: every other edge ablated", fontsize=9)
        fig.tight_layout()
        drawn.append(save_figure(fig, out_dir / "circuit_faithfulness.png"))
    return drawn
