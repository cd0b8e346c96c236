"""A training job on one process against the same job data parallel on two torchrun ranks:
training tokens/s (the job's own figure: its steps, making the activations included).

    python tests/benchmarks/train_ddp.py [--reps 3] [--tokens 65536] [--architecture topk]

Not part of the test run. experiment=train_sae on the shipped tiny_lm (its defaults: width
512, k 16, batch 1024, buffer 16384), no scoring, no pictures; streamed from the model, and
read from an earlier run's file (sae.from, an lm_cache run made first). Each job is one
process of its own: `python -m hookrun` with 2 threads and with 1, and `torchrun
--nproc_per_node 2` with 1 thread each; repetitions interleaved. Ratios are medians over the
repetitions of tokens/s over one process's with one thread (each rank's count) within one
repetition.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import hookrun

ROOT = Path(__file__).resolve().parents[2]
SPEED = re.compile(r"training: ([\d,]+) tokens/s")


def _env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def _job(launch: str, args: list[str], run_dir: Path) -> float:
    """One job's tokens/s (rank 0's line: the ranks step together)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    if launch == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node=2", "-m", "hookrun"]
        threads = 1
    else:
        cmd, threads = [sys.executable, "-m", "hookrun"], int(launch)
    done = subprocess.run(
        [*cmd, *args, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        env=_env(threads),
        cwd=run_dir.parent,
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return float(SPEED.findall(done.stdout + done.stderr)[0].replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--architecture", default="topk")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="train_ddp_bench_"))
    base = [
        "experiment=train_sae",
        f"sae.architecture={args.architecture}",
        f"sae.tokens={args.tokens}",
        f"sae.checkpoint_tokens={args.tokens}",
        "sae.heldout.rows=0",
        "render=false",
        "progress=false",
    ]
    cache = tmp / "cache"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "hookrun",
            "experiment=lm_cache",
            "sink.dtype=float32",
            "dataset.context=64",
            "render=false",
            "progress=false",
            f"hydra.run.dir={cache}",
        ],
        check=True,
        capture_output=True,
        env=_env(2),
        cwd=tmp,
    )
    sources = {"streamed": base, "from a file": [*base, f"sae.from={cache / 'captures.h5'}"]}
    launches = ["2", "1", "torchrun"]
    speeds = {(s, la): [] for s in sources for la in launches}
    for rep in range(args.reps):
        for source, job_args in sources.items():
            order = launches if rep % 2 == 0 else launches[::-1]
            for launch in order:
                speed = _job(launch, job_args, tmp / "run")
                speeds[(source, launch)].append(speed)
                print(f"rep {rep} {source} {launch}: {speed:,.0f} tokens/s", flush=True)
    print(
        f"\ntiny_lm, {args.architecture}, width 512, k 16, batch 1024, {args.tokens} tokens; "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"hookrun {hookrun.__version__}, median "
        f"of {args.reps}\n"
    )
    print("| source | 1 process, 2 threads | 1 process, 1 thread | torchrun 2 × 1 thread |")
    print("|---|---|---|---|")
    for source in sources:
        one = speeds[(source, "1")]
        cells = []
        for launch in launches:
            mine = speeds[(source, launch)]
            ratio = statistics.median(m / o for m, o in zip(mine, one, strict=True))
            cells.append(f"{statistics.median(mine):,.0f} tokens/s ({ratio:.2f}×)")
        print(f"| {source} | " + " | ".join(cells) + " |")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
