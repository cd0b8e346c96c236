"""Tokenizing a corpus for `dataset=text`: tokens per second of building the run's rows
(reading, tokenizing in batches, writing the ids) on one core (RAYON_NUM_THREADS=1: the
tokenizers library's batch encoding on one thread) and on all, without the token cache (a
temporary file, as every rank did before), making the cache (ids, plus the corpus's and the
ids' sha256), and reading it back (what a second rank or a resumed run does instead of
tokenizing). Each figure is its own process; the shipped tiny_lm's tokenizer on a corpus of
40,000 lines of 60 words (about 5 million tokens).

    python tests/benchmarks/tokenizing.py [--lines 40000]

Run it from another checkout to measure that checkout's code (the cache is skipped where
build_dataset has no `cache`). Not part of the test run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import hookrun

CHILD = """
import inspect, shutil, sys, time
from pathlib import Path
import transformers, hookrun
from hookrun.data.loader import build_dataset
from hookrun.data.text import TextDatasetConfig
shipped = Path(hookrun.__file__).parent / "models/checkpoints/tiny_lm"
tok = transformers.AutoTokenizer.from_pretrained(shipped)
corpus, mode, cache = sys.argv[1], sys.argv[2], Path(sys.argv[3])
cfg = TextDatasetConfig(path=corpus)
kw = {"cache": cache} if mode != "none" else {}
if mode != "none" and "cache" not in inspect.signature(build_dataset).parameters:
    print("nan"); raise SystemExit
if mode == "make":
    shutil.rmtree(cache, ignore_errors=True)
start = time.perf_counter()
rows = build_dataset(cfg, 0, None, tok, **kw)
seconds = time.perf_counter() - start
print(rows.store.size / seconds)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=40000)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lm"))
    import numpy as np
    from lm_models import SENTENCES

    work = Path(tempfile.mkdtemp(prefix="tokenize_"))
    words = " ".join(SENTENCES).split()
    rng = np.random.default_rng(0)
    corpus = work / "corpus.txt"
    lines = (" ".join(rng.choice(words, size=60)) for _ in range(args.lines))
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    size = corpus.stat().st_size / 2**20
    print(
        f"hookrun {hookrun.__version__}: {args.lines} lines, {size:.1f} MiB; {os.cpu_count()} cores"
    )
    for threads in ("1", None):
        env = dict(os.environ)
        env.pop("RAYON_NUM_THREADS", None)
        if threads:
            env["RAYON_NUM_THREADS"] = threads
        for mode, name in (
            ("none", "no cache (a temporary file)"),
            ("make", "making the token cache"),
            ("read", "reading the token cache"),
        ):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(corpus), mode, str(work / "cache")],
                capture_output=True,
                text=True,
                env=env,
                cwd=os.getcwd(),
            )
            if out.returncode:
                raise SystemExit(out.stderr[-2000:])
            rate = float(out.stdout.split()[-1])
            print(f"  {'1 core' if threads else 'all cores':9s} {name:32s} {rate:14,.0f} tokens/s")


if __name__ == "__main__":
    main()
