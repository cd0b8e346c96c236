"""Train the per-layer transcoders shipped beside tiny_lm: hookrun/models/checkpoints/
tiny_lm_transcoders/ (one SAELens folder per layer), which experiment=attribution_graph
uses by default.

ReLU transcoders (512 latents, L1 coefficient 2) from each block's MLP input (ln_2's output)
to its output, both trained from the same forward passes by hookrun's own
`experiment=train_sae` on the documentation strings tiny_lm was trained on (the corpus
`scripts/train_tiny_lm.py` builds from this machine's Python, no download).

Run: python scripts/train_tiny_transcoders.py [--out DIR] [--tokens N]
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

LAYERS = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = ROOT / "hookrun/models/checkpoints/tiny_lm_transcoders"
    parser.add_argument("--out", type=Path, default=default)
    parser.add_argument("--tokens", type=int, default=600_000)
    args = parser.parse_args()
    torch.set_num_threads(2)
    train_docs, _, _ = build_corpus()
    sites = ", ".join(
        f"{{in: transformer.h.{i}.mlp:input, out: transformer.h.{i}.mlp:output}}"
        for i in range(LAYERS)
    )
    with tempfile.TemporaryDirectory() as scratch:
        corpus = Path(scratch) / "train.jsonl"
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in train_docs))
        run_dir = Path(scratch) / "run"
        result = hookrun.run(
            [
                "experiment=train_sae",
                f"dataset.path={corpus}",
                f"sae.sites=[{sites}]",
                "sae.architecture=relu",
                "sae.width=512",
                "sae.l1_coefficient=2",
                f"sae.tokens={args.tokens}",
                "sae.batch=2048",
                "sae.buffer=65536",
                "sae.lr=0.001",
                f"sae.checkpoint_tokens={args.tokens // 2}",
                "sae.heldout.rows=0",
                "render=false",
                "progress=false",
            ],
            run_dir=run_dir,
        )
        print(result.summary)
        shutil.rmtree(args.out, ignore_errors=True)
        args.out.mkdir(parents=True)
        for folder in sorted((run_dir / "sae").iterdir()):
            layer = folder.name.split(".")[2]
            shutil.copytree(folder, args.out / f"layer_{layer}")
    (args.out / "training.json").write_text(
        json.dumps(
            {
                "script": "scripts/train_tiny_transcoders.py",
                "rebuild": "python scripts/train_tiny_transcoders.py",
                "tokens": args.tokens,
                "versions": {"torch": torch.__version__, "hookrun": hookrun.__version__},
                "summary": result.summary.splitlines()[-6:],
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
