"""The features job against a bare lm_cache pass, and its peak memory from 1x to 8x the corpus.

    python tests/benchmarks/features.py [--reps 3]

Each run is a process of its own (`python -m hookrun`), its wall time and peak RSS read by
wait4: `experiment=features` (the shipped tiny_lm, its SAE at transformer.h.1, 512 latents,
k 20, window [16, 8]) and `experiment=lm_cache` restricted to the same site
(`hooks.resid.select.regex=transformer\\.h\\.1`: that site's float16 rows written), on
the held-out corpus; then features on the corpus repeated 8 times. Both include the
process's start (imports, the model's load); the ratio is the median of interleaved pairs.
Not part of the test run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hookrun

CORPUS = Path(hookrun.__file__).parent / "models" / "checkpoints" / "tiny_lm" / "heldout.jsonl"


def _run(args: list[str], folder: Path) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of one `python -m hookrun ARGS` process."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hookrun", *args, f"hydra.run.dir={folder}", "render=false"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    if status:
        raise SystemExit(f"{args}: exit status {status}")
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    reps = parser.parse_args().reps
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        big = tmp / "corpus8.jsonl"
        big.write_text(CORPUS.read_text() * 8)
        cache = ["experiment=lm_cache", r"hooks.resid.select.regex=transformer\.h\.1"]
        pairs = []
        for rep in range(reps):
            f = _run(["experiment=features"], tmp / f"f{rep}")
            c = _run(cache, tmp / f"c{rep}")
            pairs.append((f, c))
        big_run = _run(["experiment=features", f"dataset.path={big}"], tmp / "big")
    ratio = statistics.median(f[0] / c[0] for f, c in pairs)
    f_s = statistics.median(f[0] for f, _ in pairs)
    c_s = statistics.median(c[0] for _, c in pairs)
    f_mem = statistics.median(f[1] for f, _ in pairs)
    print(f"features / lm_cache seconds: {ratio:.2f}x ({f_s:.1f} s vs {c_s:.1f} s)")
    print(
        f"features peak RSS: 1x corpus {f_mem:.0f} MiB, 8x corpus {big_run[1]:.0f} MiB "
        f"({big_run[1] / f_mem:.2f}x), 8x time {big_run[0]:.1f} s"
    )


if __name__ == "__main__":
    main()
