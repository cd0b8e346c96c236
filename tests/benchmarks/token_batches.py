"""Reading a language-model cache to train on: tokens per second of `TokenBatches` (shuffled
batches of 4096 from a buffer of 2^18 tokens) against h5py reading the same bytes in order
(the disk's and HDF5's speed: the ceiling), and against the per-token `Activations` reader
through a DataLoader, shuffled (what a trainer did before) and in order (its best case).
One `experiment=lm_cache` run of the shipped tiny_lm makes the file (two blocks' outputs,
float16, padded rows); every reader is timed on it while the page cache holds it, so the
figures are of reading and decoding, not of the disk.

    python tests/benchmarks/token_batches.py [--rows 4000] [--context 128]

Peak memory of TokenBatches over the epoch is printed against its buffer's size. Not part of
the test run.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader

import hookrun
from hookrun.io.activations import Activations, TokenBatches

KEY = "captures/transformer.h.1/output"


def _corpus(path: Path, rows: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lm"))
    from lm_models import SENTENCES

    words = " ".join(SENTENCES).split()
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, size=int(rng.integers(40, 120)))) for _ in range(rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _timed(name: str, tokens_of, limit: float = 60.0) -> float:
    """Tokens per second of iterating `tokens_of()` (yields token counts) for up to `limit` s."""
    start, count = time.perf_counter(), 0
    for n in tokens_of():
        count += n
        if time.perf_counter() - start > limit:
            break
    seconds = time.perf_counter() - start
    rate = count / seconds
    print(f"  {name:58s} {rate:12,.0f} tokens/s  ({count:,} tokens in {seconds:.1f} s)")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="token_batches_"))
    _corpus(work / "corpus.txt", args.rows)
    path = hookrun.run(
        [
            "experiment=lm_cache",
            f"dataset.path={work / 'corpus.txt'}",
            "dataset.pack=false",
            f"dataset.context={args.context}",
            "render=false",
            "progress=false",
        ],
        run_dir=work / "run",
    ).path
    with h5py.File(path) as f:
        ds = f[KEY]
        real = int(f["samples/mask"][()].sum())
        shape, chunks, size = ds.shape, ds.chunks, ds.id.get_storage_size()
    print(
        f"{KEY}: {shape} float16, chunks {chunks}, {size / 2**20:.0f} MiB, {real:,} real tokens "
        f"of {shape[0] * shape[1]:,} stored; torch {torch.__version__}, h5py {h5py.__version__}"
    )

    def h5py_in_order():
        with h5py.File(path) as f:
            ds = f[KEY]
            for at in range(0, shape[0], chunks[0]):
                block = ds[at : at + chunks[0]]
                yield block.shape[0] * block.shape[1]

    def batches(**kw):
        def run():
            for batch in TokenBatches(path, KEY, **kw):
                yield len(batch)

        return run

    def per_token(shuffle: bool):
        def run():
            loader = DataLoader(Activations(path, KEY), batch_size=4096, shuffle=shuffle)
            for batch in loader:
                yield len(batch)

        return run

    _timed("warm-up: h5py, in order (page cache filled)", h5py_in_order)
    ceiling = _timed("h5py, the same bytes in order (stored tokens)", h5py_in_order)
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ours = _timed("TokenBatches, shuffled, batch 4096, buffer 2^18", batches(batch_size=4096))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    in_order = _timed("TokenBatches, in order", batches(batch_size=4096, shuffle=False))
    old = _timed("Activations + DataLoader(batch 4096, shuffle)", per_token(True), limit=30)
    old_seq = _timed("Activations + DataLoader(batch 4096), in order", per_token(False), limit=30)
    buffer_mib = 2**18 * shape[2] * 4 / 2**20
    print(
        f"  TokenBatches / h5py in order: {ours / ceiling:.2f}x (goal >= 0.5x; in order "
        f"{in_order / ceiling:.2f}x); / Activations shuffled: {ours / old:.0f}x (goal >= 20x), "
        f"/ Activations in order: {ours / old_seq:.1f}x"
    )
    print(
        f"  peak resident memory before TokenBatches {start_rss:.0f} MiB, after its epoch "
        f"{peak:.0f} MiB (buffer: {buffer_mib:.0f} MiB of float32)"
    )


if __name__ == "__main__":
    main()
