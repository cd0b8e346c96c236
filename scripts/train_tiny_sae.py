"""Train the small SAE shipped beside tiny_lm: hookrun/models/checkpoints/tiny_lm_sae/.

A top-k SAE (512 latents, k = 16) on the residual stream after tiny_lm's block 1
(`blocks.1.hook_resid_post`, GPT-2's `transformer.h.1` output), trained by hookrun's own
`experiment=train_sae` on the documentation strings tiny_lm was trained on (the corpus
`scripts/train_tiny_lm.py` builds from this machine's Python, no download), and scored on
tiny_lm's held-out corpus. The tutorials and the feature dashboards use it.

Run: python scripts/train_tiny_sae.py [--out hookrun/models/checkpoints/tiny_lm_sae]
Fixed seed, CPU, two threads: the same Python, torch and corpus give the same weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from train_tiny_lm import build_corpus  # noqa: E402

import hookrun  # noqa: E402

NAME = "transformer.h.1.output.topk.w512.k16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "hookrun/models/checkpoints/tiny_lm_sae")
    parser.add_argument("--tokens", type=int, default=2_000_000)
    args = parser.parse_args()
    torch.set_num_threads(2)
    train_docs, _, _ = build_corpus()
    with tempfile.TemporaryDirectory() as scratch:
        corpus = Path(scratch) / "train.jsonl"
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in train_docs))
        run_dir = Path(scratch) / "run"
        result = hookrun.run(
            [
                "experiment=train_sae",
                f"dataset.path={corpus}",
                f"sae.tokens={args.tokens}",
                "sae.width=512",
                "sae.k=16",
                "sae.batch=2048",
                "sae.buffer=65536",
                "sae.lr=0.001",
                f"sae.checkpoint_tokens={args.tokens // 4}",
                "sae.log_steps=10",
                "sae.heldout.rows=0",  # scored on tiny_lm's own held-out corpus below
                "progress=false",
            ],
            run_dir=run_dir,
        )
        print(result.summary)
        shutil.rmtree(args.out, ignore_errors=True)
        shutil.copytree(run_dir / "sae" / NAME, args.out)
    scored = hookrun.run(
        ["experiment=sae", f"hooks.sae.args.path={args.out}", "render=false", "progress=false"],
        run_dir=Path(tempfile.mkdtemp(prefix="tiny-sae-scores-")),
    )
    print(scored.summary)
    (args.out / "training.json").write_text(
        json.dumps(
            {
                "script": "scripts/train_tiny_sae.py",
                "rebuild": "python scripts/train_tiny_sae.py",
                "tokens": args.tokens,
                "versions": {"torch": torch.__version__, "hookrun": hookrun.__version__},
                "heldout_summary": scored.summary.splitlines()[-2:],
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
