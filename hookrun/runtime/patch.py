"""The `patch` action: a site's tensor replaced by (or added to) one read from a stored
captures.h5 — a stored activation put back, mean ablation and activation addition, declared like any
hook:

    hooks:
      p: {select: {name: layer3}, at: output, action: patch,
          args: {file: clean/captures.h5, record: null, reduce: none, row: same,
                 mode: replace, scale: 1.0}}

- `record`: the source dataset (default: this site's own /captures/<layer>/<site>);
- `reduce: none | mean` (the mean over every stored row: mean ablation);
- `row: same` (the source row with this sample's dataset index, /samples/index) or an
  integer (that row for every sample);
- `mode: replace` (the site becomes scale × stored) `| add` (site + scale × stored:
  activation addition).

Everything about the source is checked before the first batch (`prepare`, once per site the
probe saw): the file exists and is complete, the record exists with the site's shape, the
rows the run needs exist. Rows are read per batch, so memory does not grow with the source.
During the passes of a derived method (integrated gradients, ...) hooks stand aside, so
those passes see the unpatched model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.io.stored import read_rows, record_rows, stored_record
from hookrun.models.weights import sha256_of
from hookrun.runtime.actions import ACTIONS, Action, SiteContext

__all__ = ["Patch", "PatchArgs"]

REDUCES = ("none", "mean")
MODES = ("replace", "add")


@dataclass
class PatchArgs:
    file: str | None = None
    """A finished run's captures.h5 to read from (relative paths from the directory you run in)."""
    record: str | None = None
    """The dataset of `file` to read; null: the site's own capture of the same module and site."""
    reduce: str = "none"
    """none | mean: mean averages every stored row (mean ablation)."""
    row: str = "same"
    """same | an integer row of the source"""
    mode: str = "replace"
    """replace | add: the site becomes scale x stored, or site + scale x stored."""
    scale: float = 1.0
    """Times the stored value, in either mode."""


@dataclass(frozen=True)
class _Source:
    """What one site reads: the dataset, and either one fixed row or a dataset-index map."""

    record: str
    fixed: torch.Tensor | None  # the stored row (or mean) every sample gets
    rows: np.ndarray | None  # dataset index → source row (row=same)


@ACTIONS.register("patch")
class Patch(Action):
    """Replace or add to the site's tensor with one read from a stored captures.h5."""

    name = "patch"
    Args = PatchArgs
    reads_rows = True

    def __init__(self, args: PatchArgs) -> None:
        super().__init__(args)
        self.path = Path(str(args.file)).expanduser()
        self.sites: dict[str, _Source] = {}
        self.sha256 = ""

    @classmethod
    def check(cls, args: PatchArgs, key: str) -> None:
        if not args.file:
            raise HookrunError(f"{key}.args.file: null; patch needs file=PATH/captures.h5")
        for field, value, valid in (("reduce", args.reduce, REDUCES), ("mode", args.mode, MODES)):
            if value not in valid:
                raise HookrunError(f"{key}.args.{field}: {value!r}; valid: {', '.join(valid)}")
        if args.row != "same" and not (args.row.isdigit()):
            raise HookrunError(f"{key}.args.row: {args.row!r}; valid: same, or a row >= 0")
        if args.reduce == "mean" and args.row != "same":
            raise HookrunError(
                f"{key}.args.row: {args.row} with reduce=mean, which uses every stored row; "
                "valid: same (the default)"
            )
        path = Path(args.file).expanduser()
        if not path.is_file():
            raise HookrunError(
                f"{key}.args.file: {args.file!r} does not exist (from {Path.cwd()}); valid: the "
                "captures.h5 of a finished run"
            )

    def prepare(
        self, shape: tuple[int, ...], site: str, key: str, rows: int, measured: Any = None
    ) -> None:
        """Check the source for the site `site` (per-sample `shape`) of a run over dataset
        rows 0..rows-1; HookrunError naming `key.args.<x>` before any work."""
        args, file = self.args, self.path
        record = (args.record or site).lstrip("/")
        state, stored, datasets = stored_record(file, record)
        if state.status != "complete":
            raise HookrunError(
                f"{key}.args.file: {args.file} is not complete (status {state.status}, "
                f"{state.completed} rows); valid: a finished run's file (resume=true finishes it)"
            )
        if stored is None:
            raise HookrunError(
                f"{key}.args.record: '/{record}' is not in {args.file}; valid: "
                + ", ".join(f"/{d}" for d in datasets)
            )
        note = record_rows(file, record)
        if note:  # rows by batch or folded: reading them by sample would mix samples
            raise HookrunError(
                f"{key}.args.record: '/{record}' is not stored one row per sample ({note}); "
                "valid: a record with one row per sample"
            )
        if stored != shape:
            raise HookrunError(
                f"{key}.args.record: '/{record}' holds rows of shape {list(stored)}, the site "
                f"{site.split('/', 1)[1]} has {list(shape)}; valid: a record of the site's shape"
            )
        self.sites[site] = self._source(record, state.completed, rows, key)
        self.sha256 = self.sha256 or sha256_of(file)

    def _source(self, record: str, stored_rows: int, rows: int, key: str) -> _Source:
        args, file = self.args, self.path
        if args.reduce == "mean":
            total = np.zeros((), dtype=np.float64)
            for start in range(0, stored_rows, 256):  # a chunk at a time: bounded memory
                chunk = np.arange(start, min(stored_rows, start + 256))
                total = total + read_rows(file, record, chunk).astype(np.float64).sum(0)
            return _Source(record, torch.from_numpy(total / stored_rows), None)
        if args.row != "same":
            row = int(args.row)
            if row >= stored_rows:
                raise HookrunError(
                    f"{key}.args.row: {row} is out of range: {args.file} has {stored_rows} rows; "
                    f"valid: 0..{stored_rows - 1}, or same"
                )
            return _Source(
                record, torch.from_numpy(read_rows(file, record, np.array([row]))[0]), None
            )
        index = read_rows(file, layout.SAMPLES_INDEX, np.arange(stored_rows))
        where = np.full(max(rows, int(index.max(initial=-1)) + 1), -1, dtype=np.int64)
        where[index] = np.arange(stored_rows)
        missing = np.flatnonzero(where[:rows] < 0)
        if len(missing):
            raise HookrunError(
                f"{key}.args.row: same, but dataset index {int(missing[0])} is not among the "
                f"{stored_rows} rows of {args.file} (/samples/index); valid: an integer row, "
                "or a source run over the same samples"
            )
        return _Source(record, None, where)

    def apply(self, tensor: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
        source = self.sites.get(ctx.key)
        if source is None:
            raise RuntimeError(f"patch: {ctx.key} was not called in the probe forward pass")
        if source.fixed is not None:
            stored = source.fixed.expand(tensor.shape)
        else:
            rows = source.rows[ctx.rows.cpu().numpy()]
            stored = torch.from_numpy(read_rows(self.path, source.record, rows))
        stored = self.args.scale * stored.to(tensor.device, tensor.dtype)
        return stored.contiguous() if self.args.mode == "replace" else tensor + stored

    def sources(self) -> dict[str, str]:
        return {"file": str(self.path.resolve()), "sha256": self.sha256}
