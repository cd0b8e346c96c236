"""The activation-patching stage (`patching:`, experiment=lm_patching): the layers ×
positions grids of each row, batch by batch (grid.py), and the rows that could not be scored
named once every row is written."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import h5py
import numpy as np

from hookrun.io import layout
from hookrun.io.encoding import read_floats
from hookrun.io.layout import MODEL_OUTPUT, SAMPLES_INDEX
from hookrun.stage import ParseContext, Plan, Setup, Stage, Stored, Work, register_stage
from hookrun.stages.patching.config import (
    APPROXIMATIONS,
    SITE_KINDS,
    PatchingConfig,
    parse_patching,
)
from hookrun.stages.patching.grid import PatchingGrid, plan_patching
from hookrun.stages.patching.keys import (
    CELLS,
    CLEAN_TOLERANCE,
    PATCHING,
    PATCHING_CLEAN,
    PATCHING_CORRUPTED,
    PEARSON,
    SPEARMAN,
    UNSCORABLE,
    agreement,
    flat_rows,
    mark_unscorable,
    patching_key,
    read_unscorable,
)

__all__ = ["PatchingStage"]

_SHOWN_ROWS = 10


class PatchingPlan(Plan):
    def __init__(self, grid: PatchingGrid) -> None:
        self.grid = grid

    def stored(self) -> dict[str, Stored]:
        return self.grid.stored()

    def attrs(self) -> dict[str, dict]:
        return self.grid.attrs()

    def describe(self, itemsize: int) -> str:
        return self.grid.describe(itemsize)

    def sources(self) -> dict[str, dict[str, str]]:
        clean = self.grid.clean
        return (
            {"patching.clean": {"file": str(clean.path), "sha256": clean.sha256}} if clean else {}
        )

    def batch(self, work: Work) -> dict[str, Any]:
        logits = np.asarray(work.records[MODEL_OUTPUT], dtype=np.float32)
        return self.grid.batch(work.model, work.on_device, logits)


def _rows_of(f: h5py.File, shards: list[h5py.File] | None, key: str, rows: int) -> np.ndarray:
    """Every row of dataset `key`: the file's first `rows`, or the shards' joined."""
    if shards:
        return np.concatenate([read_floats(s[key]) for s in shards])
    return read_floats(f[key], slice(0, rows))


@register_stage
class PatchingStage(Stage):
    name = node = "patching"
    order = 40
    axes = {
        patching_key(PATCHING_CLEAN): "sample",
        patching_key(PATCHING_CORRUPTED): "sample",
        patching_key("heads*"): "sample layer head position",
        f"{PATCHING}/*": "sample layer position",
    }

    @classmethod
    def schema(cls) -> Mapping[str, type]:
        return {"patching": PatchingConfig}

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> Any:
        return parse_patching(raw)

    @classmethod
    def plan(cls, config: Any, setup: Setup) -> Plan | None:
        return PatchingPlan(plan_patching(config, setup.model, setup.tokens, len(setup.data)))

    @classmethod
    def complete(cls, f: h5py.File, rows: int, shards: list[h5py.File] | None) -> None:
        """The dataset indices of the rows whose clean − corrupted logit difference is 0
        (within the stored clean logits' rounding: keys.py flat_rows)."""
        keys = (
            patching_key(PATCHING_CLEAN),
            patching_key(PATCHING_CORRUPTED),
            MODEL_OUTPUT,
            SAMPLES_INDEX,
        )
        if not all(key in f for key in keys):
            return
        parts = [[read_floats(s[key]) for key in keys] for s in shards or []]
        clean, corrupted, logits, index = (
            [np.concatenate(p) for p in zip(*parts, strict=True)]
            if parts
            else [read_floats(f[key], slice(0, rows)) for key in keys]
        )
        tolerance = float(layout.attr(f[PATCHING], CLEAN_TOLERANCE, 0.0))
        mark_unscorable(f, index[flat_rows(clean, corrupted, logits, tolerance)])
        for kind in SITE_KINDS:
            for method in APPROXIMATIONS:
                key, approx = patching_key(kind), patching_key(kind, f"_{method}")
                if key in f and approx in f:
                    exact, found = (_rows_of(f, shards, k, rows) for k in (key, approx))
                    layout.modify_attrs(f[approx], agreement(exact, found))

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        """How far each approximation is from the exact grid, and a warning naming the rows
        patching could not score (clean = corrupted)."""
        lines = []
        for kind in SITE_KINDS:
            for method in APPROXIMATIONS:
                key = patching_key(kind, f"_{method}")
                said = layout.attr(f[key], PEARSON) if key in f else None
                if said is not None:
                    spearman = layout.attr(f[key], SPEARMAN)
                    cells = layout.attr(f[key], CELLS)
                    lines.append(
                        f"patching: {kind} {method} against exact: Pearson {float(said):.3f}, "
                        f"Spearman {float(spearman):.3f} over {int(cells)} cells"
                    )
        found = read_unscorable(f)
        if found is None or not len(found):
            return lines
        shown = ", ".join(map(str, found[:_SHOWN_ROWS].tolist()))
        more = f" and {len(found) - _SHOWN_ROWS} more" if len(found) > _SHOWN_ROWS else ""
        return lines + [
            f"warning: patching could not score {len(found)} of {rows} rows (clean − corrupted "
            f"logit difference 0, or within the stored clean logits' rounding: every cell of "
            f"their grid is NaN): samples {shown}{more} "
            f"(/{PATCHING} attribute {UNSCORABLE})"
        ]

    @classmethod
    def draw(cls, f: h5py.File, out_dir: Any, rows: int, config: dict) -> list:
        from hookrun.stages.patching.draw import render_patching  # matplotlib: when drawing

        return render_patching(f, out_dir, config)
