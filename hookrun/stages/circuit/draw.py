"""The pictures of an edge attribution run: the largest edges drawn as a graph (the layers
bottom to top, the embeddings, each head, each MLP and the logits as nodes, the query, key
and value a head reads as small squares below it marked q, k, v; an edge's width its mean
|score|, its colour its sign, solid where it lies on a path from the embeddings to the
logits through the edges drawn, dashed where not), and the faithfulness of the circuits of
each size circuit.k (the share of clean − corrupted they keep) on a log-like axis of the
edges each kept.

An edge is a straight line where that passes clear of every other node, else the least
bent curve that does: nodes of one column (the embeddings, the MLPs and the logits) stand
in line, and a straight m0 → logits would pass through m1's dot."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import matplotlib
import matplotlib.ticker
import numpy as np

from hookrun.io import layout
from hookrun.io.encoding import read_floats
from hookrun.render.pictures import save_figure
from hookrun.stages.circuit.keys import EDGES, FAITHFULNESS, RECEIVERS, SENDERS, kept_of
from hookrun.stages.circuit.paths import on_paths, readers

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

__all__ = ["render_circuit", "route", "canvas", "CLEAR"]

_DRAWN = 25  # edges drawn at most
# Pixels (at the figure's dpi) an edge keeps from the centre of every node it does not join:
# a head's or an MLP's dot is about 5 px across its radius, a q/k/v square about 4.
CLEAR = {"dot": 10.0, "square": 7.0}
# Bends tried in turn, the least first: the curve's middle pushed sideways by this share of
# its length (either side).
_BENDS = tuple(b * side for b in np.arange(0.0, 0.81, 0.04) for side in (1, -1))[1:]


def _names(values) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def _place(name: str, heads: int, kv_heads: int) -> tuple[float, float]:
    """(x, y) of a node: embed at the bottom, layer l's heads in a row at 2l + 1 and its MLP
    at 2l + 2, the logits on top; a head's query, key and value just below it; with shared
    key/value heads, each query head's query just below it and a key/value head's key and
    value a row lower, below the middle of the query heads that read them (apart from the
    queries: in one row a query and the next group's key overlapped)."""
    middle = (heads - 1) / 2
    if name == "embed":
        return (middle, 0.0)
    if name == "logits":
        return (middle, 1e9)
    parts = name.split(".")
    layer = int(parts[0][1:])
    if len(parts) == 3 and parts[1].startswith("kv"):  # a<layer>.kv<group>.k or .v
        group = heads // max(kv_heads, 1)
        x = int(parts[1][2:]) * group + (group - 1) / 2
        return (x + {"k": -0.15, "v": 0.15}[parts[2]], 2.0 * layer + 0.4)
    if len(parts) == 3:  # a<layer>.h<head>.q, .k, .v
        shared = kv_heads < heads  # the head's query alone is its own
        offset = 0.0 if shared else {"q": -0.22, "k": 0.0, "v": 0.22}[parts[2]]
        return (float(parts[1][1:]) + offset, 2.0 * layer + 0.7)
    if name.startswith("a") and len(parts) == 2:  # a<layer>.h<head>: the head itself
        return (float(parts[1][1:]), 2.0 * layer + 1)
    if name.startswith("a"):  # a<layer>: a file from before receivers were per head
        return (-1.0, 2.0 * layer + 0.5)
    return (middle, 2.0 * layer + 2)


def _curve(start: np.ndarray, end: np.ndarray, bend: float) -> np.ndarray:
    """(40, 2): the quadratic Bézier from start to end (pixels) whose control point is the
    midpoint moved sideways by `bend` × twice the length (its middle: `bend` × the length)."""
    along = end - start
    side = np.array([-along[1], along[0]])
    control = (start + end) / 2 + 2 * bend * side
    t = np.linspace(0.0, 1.0, 40)[:, None]
    return (1 - t) ** 2 * start + 2 * t * (1 - t) * control + t**2 * end


def _gap(line: np.ndarray, others: np.ndarray, clear: np.ndarray) -> float:
    """How far the polyline `line` (n, 2) stays outside the least clearance `clear` (m,)
    around the points `others` (m, 2): negative where it comes closer than that."""
    if not len(others):
        return float("inf")
    a, b = line[:-1, None], line[1:, None]  # (n - 1, 1, 2) segments
    ab = b - a
    t = np.clip(((others[None] - a) * ab).sum(-1) / np.maximum((ab * ab).sum(-1), 1e-12), 0, 1)
    nearest = a + t[..., None] * ab
    return float((np.sqrt(((others[None] - nearest) ** 2).sum(-1)) - clear[None]).min())


def route(start: np.ndarray, end: np.ndarray, others: np.ndarray, clear: np.ndarray) -> np.ndarray:
    """The points (pixels) of an edge from `start` to `end` that keep `clear` (m,) pixels from
    `others` (m, 2: the centres of every node the edge does not join): straight if that does,
    else the least bent of _BENDS that does; where none does, the one that comes least close."""
    best, widest = None, -np.inf
    for bend in _BENDS:
        line = _curve(start, end, bend)
        gap = _gap(line, others, clear)
        if gap >= 0:
            return line
        if gap > widest:
            best, widest = line, gap
    assert best is not None
    return best


def _chosen(mean: np.ndarray) -> list[tuple[int, int]]:
    """The (sender, receiver) of the _DRAWN edges of largest mean |score|."""
    flat = np.argsort(-np.nan_to_num(np.abs(mean), nan=-1.0), axis=None, kind="stable")[:_DRAWN]
    return [np.unravel_index(i, mean.shape) for i in flat if np.isfinite(mean.flat[i])]


def render_circuit(f: h5py.File, out_dir: Path, rows: int) -> list[Path]:
    if EDGES not in f or rows < 1:
        return []
    ds = f[EDGES]
    senders, receivers = _names(layout.attr(ds, SENDERS)), _names(layout.attr(ds, RECEIVERS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(read_floats(ds, slice(0, rows)).astype(np.float64), axis=0)
    chosen = _chosen(mean)
    picked = np.zeros(mean.shape, dtype=bool)
    for s, r in chosen:
        picked[s, r] = True
    joined = on_paths(picked, readers(senders, receivers))
    drawn = [_circuit_picture(ds, out_dir, mean, chosen, joined)]
    if FAITHFULNESS in f:
        drawn.append(_faithfulness_picture(f[FAITHFULNESS], out_dir))
    return drawn


@dataclass
class _Canvas:
    """The circuit picture's axes, every node's place (data coordinates) and the nodes an
    edge must keep clear of (the senders, the logits, the q/k/v squares drawn), with the
    axes' limits fixed so that pixels are known before any edge is routed."""

    fig: Any
    ax: Any
    spot: dict[str, tuple[float, float]]
    nodes: list[str]

    def line(self, sender: str, receiver: str) -> np.ndarray:
        """The edge's points (data coordinates): route() between its ends, in pixels."""
        to_pixels = self.ax.transData.transform
        centres = to_pixels(np.array([self.spot[n] for n in self.nodes]))
        clear = np.array([CLEAR[_shape(n)] for n in self.nodes])
        others = [i for i, n in enumerate(self.nodes) if n not in (sender, receiver)]
        ends = to_pixels(np.array([self.spot[sender], self.spot[receiver]]))
        line = route(ends[0], ends[1], centres[others], clear[others])
        return self.ax.transData.inverted().transform(line)


def _shape(name: str) -> str:
    """How a node is drawn: a q/k/v square (a head's input), else a dot."""
    return "square" if name.count(".") == 2 else "dot"


def canvas(senders: list[str], receivers: list[str], kv_heads: int, squares: list[str]) -> _Canvas:
    """The circuit picture's empty canvas for these nodes (`squares`: the heads' inputs drawn)."""
    heads = sum(1 for s in senders if s.startswith("a0.h"))
    layers = sum(1 for r in receivers if r.startswith("m"))
    # At least as wide as the title's second line.
    fig, ax = plt.subplots(figsize=(max(6.0, 2.5 + 0.9 * heads), 2.5 + 1.1 * layers))
    spot = {n: _place(n, heads, kv_heads) for n in senders + receivers}
    spot["logits"] = ((heads - 1) / 2, 2.0 * layers + 1)
    nodes = [*senders, "logits", *squares]
    xs = [spot[n][0] for n in nodes]
    ax.set_xlim(min(xs) - 0.8, max(xs) + 0.8)
    ax.set_ylim(-0.6, 2.0 * layers + 1.6)
    ax.set_axis_off()
    return _Canvas(fig, ax, spot, nodes)


def _circuit_picture(
    ds: h5py.Dataset,
    out_dir: Path,
    mean: np.ndarray,
    chosen: list[tuple[int, int]],
    joined: np.ndarray,
) -> Path:
    senders, receivers = _names(layout.attr(ds, SENDERS)), _names(layout.attr(ds, RECEIVERS))
    heads = sum(1 for s in senders if s.startswith("a0.h"))
    kv_heads = int(layout.attr(ds, "key_value_heads") or heads)
    top = max((abs(mean[s, r]) for s, r in chosen), default=1.0) or 1.0
    squares = sorted({receivers[r] for _, r in chosen if receivers[r].count(".") == 2})
    drawing = canvas(senders, receivers, kv_heads, squares)
    fig, ax, spot = drawing.fig, drawing.ax, drawing.spot
    for s, r in chosen:
        line = drawing.line(senders[s], receivers[r])
        on = bool(joined[s, r])
        ax.plot(
            line[:, 0],
            line[:, 1],
            color="tab:red" if mean[s, r] > 0 else "tab:blue",
            linewidth=0.5 + 4 * abs(mean[s, r]) / top,
            alpha=0.7 if on else 0.35,
            linestyle="-" if on else "--",
        )
    for name in senders + ["logits"]:
        x, y = spot[name]
        ax.scatter([x], [y], s=60, color="0.2", zorder=3)
        ax.annotate(name, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    for name in squares:  # the heads' inputs the drawn edges reach
        x, y = spot[name]
        if ".h" in name:  # a head's own input: tied to the head above it
            hx, hy = spot[name.rsplit(".", 1)[0]]
            ax.plot([x, hx], [y, hy], color="0.6", linewidth=0.6, zorder=2)
        ax.scatter([x], [y], s=30, marker="s", facecolors="white", edgecolors="0.2", zorder=3)
        ax.annotate(name.split(".")[2], (x, y), fontsize=6, ha="center", va="center", zorder=4)
    ax.set_title(
        f"the {len(chosen)} edges of largest mean |{layout.attr(ds, 'method')} score|\n"
        f"solid: the {int(joined.sum())} on a path embed → logits through them; dashed: the "
        "others; red: toward the clean answer",
        fontsize=8,
    )
    return save_figure(fig, out_dir / "circuit.png")


def _faithfulness_picture(ds: h5py.Dataset, out_dir: Path) -> Path:
    """Each circuit's share of clean − corrupted against the edges it kept (the k chosen
    where the file has no /circuit/faithfulness_kept), on a symmetric-log axis: 0, 1, 2, 5,
    10, ... apart."""
    sizes = np.asarray(layout.attr(ds, "k"), dtype=np.int64)
    kept = kept_of(ds.file)
    edges = sizes if kept is None else kept
    shares = ds[()]
    order = np.argsort(sizes, kind="stable")
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot(edges[order], shares[order], marker="o")
    points: dict[tuple[int, float], list[int]] = {}
    for k, n, share in zip(sizes.tolist(), edges.tolist(), shares.tolist(), strict=True):
        points.setdefault((n, share), []).append(k)
    for (n, share), ks in points.items():
        if ks != [n]:  # the path rule dropped some of the k chosen: say which k it was
            said = "k=" + ", ".join(map(str, sorted(ks)))
            ax.annotate(said, (n, share), fontsize=6, xytext=(3, -9), textcoords="offset points")
    # Linear below 1 edge, logarithmic above: 0, 1, 2, 5, 10, ... apart, 0 drawn.
    ax.set_xscale("symlog", linthresh=1.0, linscale=0.5)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_locator(
        matplotlib.ticker.SymmetricalLogLocator(linthresh=1.0, base=10, subs=range(2, 10))
    )
    ax.set_xlim(left=-0.3)
    ax.axhline(1.0, color="0.6", linewidth=0.8)
    ax.axhline(0.0, color="0.6", linewidth=0.8)
    ax.set_xlabel(
        "edges kept: of the k largest mean |score|, those on a path embed → logits"
        if kept is not None
        else "edges kept (the largest mean |score|)",
        fontsize=8,
    )
    ax.set_ylabel("share of clean - corrupted kept")
    ax.set_title("circuit faithfulness: every other edge ablated", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, out_dir / "circuit_faithfulness.png")
