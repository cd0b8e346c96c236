"""Batches of a sparse record for the sparse tests, the same in every process: made from the
batch's number alone, with the dense array they stand for built here by plain numpy indexing
(not by hookrun's densify), and a writer a test runs as a child process it kills.

`python sparse_batches.py PATH BATCHES [PAUSE]`: append BATCHES batches to a new PATH, PAUSE
seconds apart (a test SIGKILLs it on the way).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from hookrun.io.appender import CapturesFile, FileOptions
from hookrun.io.sparse import SparseRows

KEY = "sae/h.1/output/latents"
ROWS, TOKENS, WIDTH, L0 = 4, 6, 512, 5


def options(dtype: str = "float32", **kw) -> FileOptions:
    """What the writer knows of the record (rows, tokens, width)."""
    shape = (kw.pop("tokens", TOKENS), kw.pop("width", WIDTH))
    spec = {KEY: (shape, ("sample", "token", "latent"))}
    return FileOptions(dtype=dtype, batch_size=ROWS, sparse=spec, **kw)


def batch(b: int, rows: int = ROWS, tokens: int = TOKENS, width: int = WIDTH, l0: int = L0):
    """Batch `b`: (arrays for CapturesFile.append, the dense record (rows, T, width)).

    Each token has 0 to 2·l0 non-zeros at distinct latents, increasing (row-major order).
    """
    rng = np.random.default_rng(b)
    counts = rng.integers(0, 2 * l0 + 1, size=(rows, tokens)).astype(np.int32)
    latent = np.concatenate(
        [np.sort(rng.choice(width, size=c, replace=False)) for c in counts.reshape(-1)]
    ).astype(np.int32)
    values = rng.standard_normal(len(latent)).astype(np.float32)
    dense = np.zeros((rows * tokens, width), dtype=np.float32)
    token = 0
    at = 0
    for c in counts.reshape(-1):
        dense[token, latent[at : at + c]] = values[at : at + c]
        token, at = token + 1, at + c
    arrays = {
        "samples/index": np.arange(b * rows, (b + 1) * rows, dtype=np.int64),
        "model/output": dense.reshape(rows, tokens, width)[:, 0, :3].copy(),
        KEY: SparseRows(counts, values, latent),
    }
    return arrays, dense.reshape(rows, tokens, width)


def write(path: Path, batches: range, file: CapturesFile | None = None) -> CapturesFile:
    """Append `batches` to `file` (or a new file at `path`); left open."""
    file = file or CapturesFile.create(path, {"config": "{}", "status": "running"}, options())
    for b in batches:
        file.append(batch(b)[0])
    return file


if __name__ == "__main__":
    target, count = Path(sys.argv[1]), int(sys.argv[2])
    pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    out = CapturesFile.create(target, {"config": "{}"}, options())
    for b in range(count):
        out.append(batch(b)[0])
        print(b, flush=True)
        time.sleep(pause)
    out.close()
