"""Reading a language-model cache to train on: tokens per second of `TokenBatches` (shuffled
batches of 4096 from a buffer of 2^18 tokens) against h5py reading the same bytes in order
(the disk's and HDF5's speed: the ceiling), and against the per-token `Activations` reader
through a DataLoader, shuffled (what a trainer did before) and in order (its best case).
One `experiment=lm_cache` run of the shipped tiny_lm makes the file (two blocks' outputs,
float16, padded rows); every reader is timed on it while the page cache holds it, so the
figures are of reading and decoding, not of the disk.

    python tests/benchmarks/token_batches.py [--rows 4000] [--context 128] [--repeats 5]
        [--file captures.h5] [--no-per-token]

h5py and TokenBatches (shuffled, in order, resumed half-way) are timed `--repeats` times,
interleaved, so that their ratios are of the same minutes; the figures are the medians.
`--file` times an existing file of the same key (one made by an earlier run, whose path is
printed) instead of making one; `--no-per-token` leaves out the per-token reader's slow
minute. Peak memory of TokenBatches over the epoch is printed against its buffer's size. Not part of
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


def _rate(tokens_of, limit: float = 60.0) -> tuple[float, int, float]:
    """Tokens per second of iterating `tokens_of()` (yields token counts) for up to `limit` s,
    the tokens and the seconds."""
    start, count = time.perf_counter(), 0
    for n in tokens_of():
        count += n
        if time.perf_counter() - start > limit:
            break
    seconds = time.perf_counter() - start
    return count / seconds, count, seconds


def _timed(name: str, tokens_of, limit: float = 60.0) -> float:
    rate, count, seconds = _rate(tokens_of, limit)
    print(f"  {name:58s} {rate:12,.0f} tokens/s  ({count:,} tokens in {seconds:.1f} s)")
    return rate


def _medians(named: dict, repeats: int) -> dict[str, float]:
    """Each reader's median tokens per second over `repeats` rounds, the readers interleaved
    in each round (a machine's slower minute slows them all, not one)."""
    rates = {name: [] for name in named}
    for _ in range(repeats):
        for name, tokens_of in named.items():
            rates[name].append(_rate(tokens_of)[0])
    for name, each in rates.items():
        spread = f"{min(each):,.0f}–{max(each):,.0f}"
        print(f"  {name:58s} {np.median(each):12,.0f} tokens/s  (median of {repeats}: {spread})")
    return {name: float(np.median(each)) for name, each in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--file", type=Path, default=None)
    parser.add_argument("--no-per-token", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    path = args.file
    if path is None:
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
    print(f"file: {path}")
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

    def batches(start: int = 0, **kw):
        def run():
            reader = TokenBatches(path, KEY, **kw)
            resumed = getattr(reader, "batches", None)  # readers before resumption: none
            for batch in resumed(start) if resumed else reader:
                yield len(batch)

        return run

    def per_token(shuffle: bool):
        def run():
            loader = DataLoader(Activations(path, KEY), batch_size=4096, shuffle=shuffle)
            for batch in loader:
                yield len(batch)

        return run

    _timed("warm-up: h5py, in order (page cache filled)", h5py_in_order)
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    _rate(batches(batch_size=4096))  # one shuffled epoch alone: its peak memory
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    half = len(TokenBatches(path, KEY, batch_size=4096)) // 2
    rates = _medians(
        {
            "h5py, the same bytes in order (stored tokens)": h5py_in_order,
            "TokenBatches, shuffled, batch 4096, buffer 2^18": batches(batch_size=4096),
            "TokenBatches, in order": batches(batch_size=4096, shuffle=False),
            f"TokenBatches, shuffled, from batch {half} of {2 * half}": batches(
                half, batch_size=4096
            ),
        },
        args.repeats,
    )
    ceiling, ours, in_order, resumed = rates.values()
    print(
        f"  TokenBatches / h5py in order: {ours / ceiling:.2f}x (goal >= 0.5x; in order "
        f"{in_order / ceiling:.2f}x); the second half of the epoch, resumed: "
        f"{ours / 2 / resumed:.2f} of the whole epoch's time"
    )
    if not args.no_per_token:
        old = _timed("Activations + DataLoader(batch 4096, shuffle)", per_token(True), limit=30)
        old_seq = _timed(
            "Activations + DataLoader(batch 4096), in order", per_token(False), limit=30
        )
        print(
            f"  / Activations shuffled: {ours / old:.0f}x (goal >= 20x), in order: "
            f"{ours / old_seq:.1f}x"
        )
    buffer_mib = 2**18 * shape[2] * 2 / 2**20
    print(
        f"  peak resident memory before TokenBatches {start_rss:.0f} MiB, after its epoch "
        f"{peak:.0f} MiB (buffer: {buffer_mib:.0f} MiB of float16)"
    )


if __name__ == "__main__":
    main()
