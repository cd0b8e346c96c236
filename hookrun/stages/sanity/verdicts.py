"""Each sanity-checked method's verdict, from all the rows of a file: its score is the mean
over the randomisation steps of the median VERDICT_SIMILARITY, and it passes below the
threshold. Written before the file is marked complete (over every shard at a torchrun
join), read by the summary, the pictures, verify and a sweep's ranking."""

from __future__ import annotations

import h5py
import numpy as np

from hookrun.io import walk
from hookrun.io.encoding import read_floats
from hookrun.stages.sanity.keys import (
    SANITY,
    VERDICT_SIMILARITY,
    mark_verdict,
    read_sanity,
    verdict_of,
)

__all__ = ["write_verdicts", "read_verdicts"]


def write_verdicts(f: h5py.File, rows: int, shards: list[h5py.File] | None = None) -> None:
    """Each sanity verdict from the first `rows` rows (or the `shards` a join reads), before a
    file is complete: score = mean over steps of the median VERDICT_SIMILARITY < threshold."""
    for method, datasets in walk.group_of(f, SANITY).items():
        if VERDICT_SIMILARITY in datasets and rows:
            ds = datasets[VERDICT_SIMILARITY]
            parts = [read_floats(s[ds.name]) for s in shards or []] or [ds[:rows]]
            score = float(np.mean(np.median(np.concatenate(parts)[:, 1:], axis=0)))
            mark_verdict(f, method, score, score < read_sanity(f)[1])


def read_verdicts(f: h5py.File) -> dict[str, tuple[bool, float] | None]:
    """method → (passed, score), or None where a method's group has no verdict."""
    return {method: verdict_of(f, method) for method in walk.group_of(f, SANITY)}
