"""The feature dashboards' part of a captures.h5 (experiment=features), its paths and how it
reads back: `/features/<module>/<site>/…`, one group per site, every unit of it (a
dictionary's latents, or the site's own units). The layout in full is in
docs/architecture.md; the job writes it (hookrun/stages/features/), the viewer and
`hookrun.open(path).feature(...)` read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from hookrun.io.layout import attr

__all__ = [
    "GROUP",
    "JOB",
    "VOCAB",
    "VOCAB_LENGTH",
    "Context",
    "site_group",
    "feature_sites",
    "read_vocab",
    "feature_contexts",
]

GROUP = "features"
JOB = "features"  # the root attribute `job` of a features file
VOCAB = f"{GROUP}/vocab"  # fixed-length UTF-8, as /model/vocabulary
VOCAB_LENGTH = f"{GROUP}/vocab_length"  # each text's bytes (its trailing NULs)
# The marks around a context's maximum token in `Context.text`.
MARK = ("[[", "]]")


def site_group(module: str, site: str) -> str:
    """`features/<module>/<site>`: the group of one site's units."""
    return f"{GROUP}/{module}/{site}"


def feature_sites(f: h5py.File) -> list[tuple[str, str]]:
    """Every (module, site) the file holds dashboards of, in the file's order."""
    if GROUP not in f:
        return []
    found: list[tuple[str, str]] = []

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Group) and "max" in obj and "top" in obj:
            module, _, site = name.rpartition("/")
            found.append((module, site))

    f[GROUP].visititems(visit)
    return found


def read_vocab(f: h5py.File) -> list[str] | None:
    """Each token id's text, or None (image data, or a file without it)."""
    if VOCAB not in f:
        return None
    lengths = f[VOCAB_LENGTH][()] if VOCAB_LENGTH in f else None
    out = []
    for i, raw in enumerate(f[VOCAB][()]):
        raw = bytes(raw)
        if lengths is not None:  # the trailing NULs a fixed-length string drops
            raw = raw.ljust(int(lengths[i]), b"\0")
        out.append(raw.decode("utf-8", errors="replace"))
    return out


@dataclass(frozen=True)
class Context:
    """One context of a unit: its activation, where it is, its window as text.

    `text` is the window's tokens joined, the maximum token between `[[` and `]]`;
    `tokens` the window's texts ('' outside the row), `values` the unit's activation at
    each; image data has no text (`box`: y0, x0, y1, x1 of the receptive field instead).
    """

    value: float
    row: int
    token: int
    text: str
    tokens: tuple[str, ...] = ()
    values: tuple[float, ...] = ()
    box: tuple[int, int, int, int] | None = None


def feature_contexts(f: h5py.File, module: str, site: str, unit: int, part: str) -> list[Context]:
    """The contexts of `unit` at (module, site): `part` top (descending) or quantiles (each
    group's samples, the lowest group first); entries that never fired are left out.

    Raises:
        KeyError: no such site, or a unit past the site's units (the message says which).
    """
    path = site_group(module, site)
    if path not in f:
        held = ", ".join(f"{m}:{s}" for m, s in feature_sites(f)) or "none"
        raise KeyError(f"{module}:{site}: no feature dashboards of it in the file; held: {held}")
    group = f[path]
    units = int(attr(group, "units"))
    if not 0 <= unit < units:
        raise KeyError(f"unit {unit}: {module}:{site} has {units} units; valid: 0 to {units - 1}")
    g = group[part]
    values = np.asarray(g["value"][unit], dtype=np.float64).reshape(-1)
    rows = np.asarray(g["row"][unit]).reshape(-1)
    tokens = np.asarray(g["token"][unit]).reshape(-1)
    vocab = read_vocab(f)
    before = int(attr(group, "window_before", 0))
    out = []
    contexts = g["context"][unit] if "context" in g else None
    cvalues = g["context_value"][unit] if "context_value" in g else None
    boxes = g["box"][unit] if "box" in g else None
    for i in range(len(rows)):
        if rows[i] < 0:
            continue
        if contexts is not None and vocab is not None:
            ids = contexts.reshape(-1, contexts.shape[-1])[i]
            texts = tuple("" if t < 0 else vocab[int(t)] for t in ids)
            shown = [f"{MARK[0]}{t}{MARK[1]}" if j == before else t for j, t in enumerate(texts)]
            acts = cvalues.reshape(-1, cvalues.shape[-1])[i]
            out.append(
                Context(
                    float(values[i]),
                    int(rows[i]),
                    int(tokens[i]),
                    "".join(shown),
                    texts,
                    tuple(float(a) for a in acts),
                )
            )
        else:
            box = None
            if boxes is not None:
                box = tuple(int(b) for b in boxes.reshape(-1, 4)[i])
            out.append(Context(float(values[i]), int(rows[i]), int(tokens[i]), "", box=box))
    return out
