"""A training job's file: the run's captures.h5, holding its curves and its dictionaries.

- `/train/<name>` (a group per dictionary): attributes `name`, `architecture`, `site`,
  `width`, `k` (-1: none), `hook_name`, `scale` (expected_average_only_in's factor; 1:
  none), `folder` and `sha256` (the saved folder and its weights file's SHA-256, once saved);
- `/train/<name>/curves` (rows, fields) float64: a row every `sae.log_steps` steps and at
  the last, its attribute `fields` naming the columns (step, tokens, loss, mse,
  explained_variance, l0, dead, lr);
- `/train/<name>/scores` (fields,) float64: the scores stage's scores of the saved
  dictionary on the held-out rows (attributes `fields`, `file`: the scoring run's file).

Root attributes: the provenance every file starts with, `job: train_sae`, `status`
(running | interrupted | failed | complete), `error`, `step` and `steps` (steps done, of
how many). The file is small and always written whole from the job's state: to a
temporary name, then renamed over the old one, so a kill leaves the old or the new, each
one readable.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hookrun.io.layout import JOB_ATTR, Provenance, attr, open_readonly, set_attrs, write_header
from hookrun.io.whole_file import replaced_whole

__all__ = ["GROUP", "JOB", "Written", "write", "is_complete", "sha256_of", "read"]

GROUP = "train"
JOB = "train_sae"


@dataclass(frozen=True)
class Written:
    """One dictionary's part of the file."""

    info: dict[str, Any]  # its group's attributes
    curves: np.ndarray  # (rows, fields)
    scores: dict[str, Any] | None = None  # {"fields": [...], "values": [...], "file": str}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write(
    path: Path,
    header: Provenance,
    dictionaries: list[Written],
    fields: tuple[str, ...],
    *,
    status: str,
    error: str,
    step: int,
    steps: int,
) -> None:
    """The whole file from the job's state, replacing the old one only once it is on disk."""
    with replaced_whole(path) as temp, h5py.File(temp, "w") as f:
        write_header(f, header)
        set_attrs(f, {JOB_ATTR: JOB, "status": status, "error": error, "step": step})
        set_attrs(f, {"steps": steps, "completed": 0})
        for d in dictionaries:
            name = d.info["name"]
            group = f.create_group(f"{GROUP}/{name}")
            set_attrs(group, d.info)
            curves = group.create_dataset("curves", data=d.curves, fletcher32=True)
            set_attrs(curves, {"fields": list(fields)})
            if d.scores is not None:
                scores = group.create_dataset(
                    "scores", data=np.asarray(d.scores["values"], dtype=np.float64)
                )
                set_attrs(scores, {"fields": list(d.scores["fields"]), "file": d.scores["file"]})


def is_training_file(f: h5py.File) -> bool:
    return attr(f, JOB_ATTR) == JOB


def is_complete(path: Path) -> bool:
    try:
        with open_readonly(path) as f:
            return attr(f, "status") == "complete"
    except OSError:
        return False


def read(f: h5py.File) -> list[dict[str, Any]]:
    """Each dictionary of a training file: its attributes, curves (field → array) and
    scores (field → value, or None)."""
    out = []
    for name in f.get(GROUP, {}):
        group = f[GROUP][name]
        info = {k: attr(group, k) for k in group.attrs}
        curves = group["curves"][()]
        fields = [str(x) for x in attr(group["curves"], "fields", [])]
        info["curves"] = {k: curves[:, i] for i, k in enumerate(fields)} if len(curves) else {}
        info["scores"] = None
        if "scores" in group:
            ds = group["scores"]
            names = [str(x) for x in attr(ds, "fields", [])]
            info["scores"] = dict(zip(names, (float(v) for v in ds[()]), strict=True))
            info["scores_file"] = str(attr(ds, "file", ""))
        out.append(info)
    return out


def damage(f: h5py.File, complete: bool) -> list[str]:
    """What a training file lacks: a dictionary without curves, and once complete, one
    without its saved folder (or whose weights changed since) or its scores where the
    job scored."""
    found = []
    if GROUP not in f:
        return [f"/{GROUP}: missing (a training file holds a group per dictionary)"]
    for name in f[GROUP]:
        group = f[GROUP][name]
        if "curves" not in group:
            found.append(f"/{GROUP}/{name}/curves: missing")
        if not complete:
            continue
        folder = Path(str(attr(group, "folder", "")))
        weights = folder / "sae_weights.safetensors"
        if not str(attr(group, "folder", "")) or not weights.is_file():
            found.append(
                f"/{GROUP}/{name}: its saved folder {folder} has no sae_weights.safetensors"
            )
        elif sha256_of(weights) != str(attr(group, "sha256", "")):
            found.append(f"/{GROUP}/{name}: {weights} changed since the job saved it (SHA-256)")
    return found
