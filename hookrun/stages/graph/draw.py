"""The picture of each pruned graph: nodes by position (x) and layer (y: embeddings at the
bottom, logits at the top), the kept edges drawn with width by weight (blue positive, red
negative)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

import hookrun.stages.graph.keys as keys
from hookrun.io.layout import attr

__all__ = ["draw_graphs", "picture_name"]


def _places(f: h5py.Group) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each node's (x, y) and kind (0 feature, 1 error, 2 token, 3 logit)."""
    features = f[keys.FEATURES][()][f[keys.SELECTED][()]]
    t = f[keys.TOKENS].shape[0]
    layers = int(attr(f, "layers"))
    k = f[keys.LOGIT_TOKENS].shape[0]
    xs = [features[:, 1], np.tile(np.arange(t), layers), np.arange(t), np.full(k, t - 1.0)]
    ys = [
        features[:, 0] + 1.0,
        np.repeat(np.arange(layers), t) + 1.0,
        np.zeros(t),
        np.full(k, layers + 1.0),
    ]
    kinds = [np.full(len(x), i) for i, x in enumerate(xs)]
    return np.concatenate(xs).astype(float), np.concatenate(ys), np.concatenate(kinds)


_PREFIX = "attribution_graph_row"


def picture_name(row: int) -> str:
    """The file name of row `row`'s picture (the job's page links to it before it is drawn)."""
    return f"{_PREFIX}{row}.png"


def draw_graphs(path: Path, out_dir: Path, texts: dict[int, list[str]] | None = None) -> list[Path]:
    """One PNG per prompt's pruned graph in `out_dir`; `texts`: each row's token texts, the
    positions' labels (else their numbers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(f"{_PREFIX}*.png"):  # an earlier run's, maybe more
        stale.unlink()
    drawn = []
    with h5py.File(path, "r") as f:
        for name in sorted(f.get(keys.GROUP, {}), key=int):
            g = f[keys.row_group(int(name))]
            x, y, kind = _places(g)
            rng = np.random.default_rng(0)
            x = x + np.where(kind < 2, rng.uniform(-0.3, 0.3, x.shape), 0.0)  # spread a cell
            crow, col, val = g[keys.CROW][()], g[keys.COL][()], g[keys.VAL][()]
            rows = np.repeat(np.arange(crow.size - 1), np.diff(crow))
            keep = g[keys.EDGE_MASK][()]
            nodes = g[keys.NODE_MASK][()]
            fig, ax = plt.subplots(figsize=(10, 6))
            if keep.any():
                w = val[keep]
                segs = np.stack(
                    [
                        np.stack([x[col[keep]], y[col[keep]]], 1),
                        np.stack([x[rows[keep]], y[rows[keep]]], 1),
                    ],
                    1,
                )
                width = 0.3 + 3.0 * np.abs(w) / np.abs(w).max()
                colors = np.where(w[:, None] > 0, [[0.1, 0.3, 0.9, 0.5]], [[0.9, 0.2, 0.1, 0.5]])
                ax.add_collection(LineCollection(segs, linewidths=width, colors=colors))
            marks = {
                0: ("o", "tab:green", "feature"),
                1: ("s", "tab:gray", "error"),
                2: ("^", "black", "token"),
                3: ("*", "tab:orange", "logit"),
            }
            for k, (marker, color, label) in marks.items():
                sel = nodes & (kind == k)
                ax.scatter(x[sel], y[sel], marker=marker, c=color, s=40, label=label, zorder=3)
            layers = int(attr(g, "layers"))
            ax.set_yticks(range(layers + 2), ["emb", *[f"L{i}" for i in range(layers)], "logit"])
            labels = (texts or {}).get(int(name))
            if labels is not None:
                ax.set_xticks(
                    range(len(labels)), [f"{i}\n{t!r}"[:24] for i, t in enumerate(labels)]
                )
                ax.tick_params(axis="x", labelsize=7)
            ax.set_xlabel("position")
            ax.set_title(
                f"row {name}: {int(nodes.sum())} nodes, {int(keep.sum())} edges kept; "
                f"replacement {attr(g, 'replacement_score'):.3f}, completeness "
                f"{attr(g, 'completeness_score'):.3f}"
            )
            ax.legend(loc="upper left", fontsize=8)
            file = out_dir / picture_name(int(name))
            fig.savefig(file, dpi=100, bbox_inches="tight")
            plt.close(fig)
            drawn.append(file)
    return drawn
