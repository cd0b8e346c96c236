"""Feature dashboards of every latent: `python -m hookrun experiment=features` against
SAEDashboard 0.8.0's runner (`SaeVisRunner`, tests/features/saedashboard_script.py in the
venv tests/reference_venvs.py builds) on the same SAE and corpus, whole processes timed.

    python tests/benchmarks/features_vs_saedashboard.py [--repeat 2] [--latents 512]
        [--reps 3] [--minibatch-tokens 64] [--minibatch-features 256]

Not part of the test run. The SAE: the shipped tiny_lm_sae (topk, 512 latents at
transformer.h.1's output). The corpus: tiny_lm's held-out documents `--repeat` times over,
packed into rows of 128 tokens as dataset=text packs them (the same rows both sides: the
test's `packed_rows`; hookrun reads a .jsonl of the repeated documents). SAEDashboard runs
with its defaults but the settings saedashboard_script.py's docstring gives (buffer=None,
top 20, 5 interval groups of 5, 50 bins, 10 logits; 64 rows a forward pass, 256 latents a
pass over the corpus), hookrun with experiment=features' defaults and render=false. Each
repetition runs both processes, alternating which goes first; a time is the process's wall
clock from start to exit (imports, model and SAE loading, tokenizing on hookrun's side, the
file written); the ratio is the median over repetitions of SAEDashboard's / hookrun's within
one repetition. SAEDashboard's own runner seconds (inside its process) give its latents/s.
Until experiment=features exists, hookrun's side reports why it failed and the table has
SAEDashboard's times alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import hookrun

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "features"))
from reference_venvs import saedashboard_python  # noqa: E402
from test_features_vs_saedashboard import SAE, SCRIPT, TINY_LM, packed_rows  # noqa: E402


def _saedashboard(tmp: Path, args: argparse.Namespace) -> tuple[float, dict]:
    out = tmp / "saedashboard.json"
    latents = ",".join(map(str, range(args.latents)))
    command = [str(saedashboard_python()), str(SCRIPT), str(TINY_LM), str(SAE)]
    command += [str(tmp / "tokens.npy"), str(out), latents, "--bench"]
    command += ["--minibatch-tokens", str(args.minibatch_tokens)]
    command += ["--minibatch-features", str(args.minibatch_features)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"SAEDashboard failed:\n{done.stderr[-4000:]}")
    return seconds, json.loads(out.read_text())


def _hookrun(tmp: Path, rep: int, args: argparse.Namespace) -> float | str:
    """Whole-process seconds, or the reason it did not finish."""
    run_dir = tmp / f"hookrun-{rep}"
    overrides = [
        "experiment=features",
        f"hooks.sae.args.path={SAE}",
        f"dataset.path={tmp / 'corpus.jsonl'}",
        "dataset.context=128",
        "render=false",
        "progress=false",
        f"hydra.run.dir={run_dir}",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "hookrun", *overrides],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    seconds = time.perf_counter() - start
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines()
        # the line naming the problem: hookrun's one-line error, hydra's "Could not find"
        named = [line for line in lines if "rror" in line or "Could not" in line] or lines
        return f"rc {done.returncode}: {named[0] if named else ''}"
    with hookrun.open(run_dir / "captures.h5") as f:  # a time only for a run that finished
        if f.status != "complete":
            return f"its file is {f.status}"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--latents", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--minibatch-tokens", type=int, default=64)
    parser.add_argument("--minibatch-features", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        rows = packed_rows(repeat=args.repeat)
        np.save(tmp / "tokens.npy", rows)
        docs = (TINY_LM / "heldout.jsonl").read_text().splitlines() * args.repeat
        (tmp / "corpus.jsonl").write_text("".join(f"{d}\n" for d in docs))
        theirs, inner, ours = [], [], []
        for rep in range(args.reps):
            if rep % 2:
                ours.append(_hookrun(tmp, rep, args))
            seconds, report = _saedashboard(tmp, args)
            theirs.append(seconds)
            inner.append(report["seconds"])
            if not rep % 2:
                ours.append(_hookrun(tmp, rep, args))
            print(
                f"rep {rep}: SAEDashboard {seconds:.1f} s (runner {inner[-1]:.1f} s), "
                f"hookrun {ours[-1] if isinstance(ours[-1], str) else f'{ours[-1]:.1f} s'}"
            )
    tokens = rows.size
    print(
        f"\n{platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, device cpu; {rows.shape[0]} rows x 128 = {tokens} tokens, "
        f"{args.latents} latents"
    )
    print("| what | median | per second |")
    print("|---|---|---|")
    t, r = statistics.median(theirs), statistics.median(inner)
    print(f"| SAEDashboard, whole process | {t:.1f} s | {args.latents / t:.1f} latents/s |")
    print(
        f"| SAEDashboard, its runner alone | {r:.1f} s | {args.latents / r:.1f} latents/s, "
        f"{tokens / r:,.0f} tokens/s |"
    )
    if all(isinstance(s, float) for s in ours):
        h = statistics.median(ours)
        ratio = statistics.median(a / b for a, b in zip(theirs, ours, strict=True))
        print(
            f"| hookrun experiment=features, whole process | {h:.1f} s | "
            f"{args.latents / h:.1f} latents/s |"
        )
        print(f"| ratio SAEDashboard / hookrun (goal >= 2x) | {ratio:.2f}x | |")
    else:
        print(f"| hookrun experiment=features | not run: {ours[0]} | |")


if __name__ == "__main__":
    main()
