"""Each prompt's graph kept in a small file of its own until the run's file is assembled.

A graph is written, whole, to `<file>.rows/row-<r>-<digest>.h5` as soon as it is computed
(its JSON and page already beside the run), so memory holds one graph at a time and a kill
loses at most the graph being computed: `resume=true` takes every row whose file is there
under the same digest — the graph config, the model's weights file, each transcoder's
sha256 and the prompt's tokens — and computes the rest. The run's file is then assembled
from the row files (copied group by group, written whole) and the folder removed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

import hookrun.stages.graph.keys as keys
from hookrun.dictionaries.dictionary import Dictionary
from hookrun.io.dimensions import AxisFacts, name_dimensions
from hookrun.io.layout import JOB_ATTR, set_attrs, write_header
from hookrun.io.whole_file import replaced_whole
from hookrun.stages.graph.attribution import Graph
from hookrun.stages.graph.config import GraphConfig
from hookrun.stages.graph.prune import Pruned

__all__ = ["Row", "RowFiles", "assemble"]


@dataclass
class Row:
    """One prompt's results: its graph, pruned and scored, and the logits it gave."""

    graph: Graph
    pruned: Pruned
    scores: tuple[float, float]  # replacement, completeness
    logits: torch.Tensor  # (V,) at the last position
    intervened: torch.Tensor  # (K, V) under each of graph.interventions


def _fill(group: h5py.Group, done: Row) -> None:
    g, p, (replacement, completeness) = done.graph, done.pruned, done.scores
    arrays = {
        keys.TOKENS: g.tokens,
        keys.FEATURES: g.features,
        keys.ACTIVATIONS: g.activations,
        keys.SELECTED: g.selected,
        keys.LOGIT_TOKENS: g.logit_tokens,
        keys.LOGIT_PROBABILITIES: g.logit_probabilities,
        keys.CROW: g.crow,
        keys.COL: g.col,
        keys.VAL: g.val,
        keys.INFLUENCE: p.influence,
        keys.CUMULATIVE: p.cumulative,
        keys.NODE_MASK: p.node_mask,
        keys.EDGE_MASK: p.edge_mask,
        keys.LOGITS: done.logits,
    }
    if done.intervened.numel():
        arrays[keys.INTERVENTION_LOGITS] = done.intervened
    for name, value in arrays.items():
        data = np.asarray(value.numpy())
        group.create_dataset(name, data=data, fletcher32=data.size > 0)
    set_attrs(
        group,
        {
            "replacement_score": replacement,
            "completeness_score": completeness,
            "layers": g.layers,
            "nodes": g.n_nodes,
        },
    )


class RowFiles:
    """The folder of one run's row files (see the module docstring)."""

    def __init__(self, path: Path, config: GraphConfig, weights: Any, tcs: list[Dictionary]):
        self.folder = path.with_name(path.name + ".rows")
        what = {"graph": repr(config), "weights": str(weights), "tcs": [t.sha256 for t in tcs]}
        self._base = json.dumps(what, sort_keys=True)

    def path(self, row: int, tokens: torch.Tensor) -> Path:
        """Where row `row`'s graph of `tokens` lives (its digest in the name)."""
        text = self._base + json.dumps(tokens.tolist())
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self.folder / f"row-{row}-{digest}.h5"

    def write(self, file: Path, done: Row) -> None:
        """A row's file, written whole."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with replaced_whole(file) as temp, h5py.File(temp, "w", track_order=True) as f:
            _fill(f, done)

    def clear(self) -> None:
        """The folder gone (the run's file holds every row now, or a new run begins)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def assemble(path: Path, header: Any, files: list[Path], interventions: int) -> None:
    """The run's file from the row files, written whole (a kill leaves the old file or the
    new one)."""
    with replaced_whole(path) as temp, h5py.File(temp, "w", track_order=True) as f:
        write_header(f, header)
        set_attrs(
            f,
            {
                JOB_ATTR: keys.JOB,
                "status": "complete",
                "error": "",
                "completed": len(files),
                "rows": len(files),
                "interventions": interventions,
            },
        )
        parent = f.require_group(keys.GROUP)
        for row, file in enumerate(files):
            with h5py.File(file, "r") as src:
                src.copy(src["/"], parent, name=str(row))
        name_dimensions(f, AxisFacts())
