"""experiment=lrp (epsilon_plus_flat) against Zennit 0.5.1's `Gradient` attributor with the
same composite and ResNetCanonizer, images/s, each side in its own process, repetitions
interleaved, medians.

    python tests/benchmarks/lrp.py [--count 32] [--size 224] [--batch 8] [--reps 3]

ResNet-18 with seeded random weights (speed does not depend on the values), the same random
images on both sides, the predicted class as the target, the relevance of each batch
written to HDF5 on both sides. hookrun: `hookrun.run(["experiment=lrp", ...], model=...,
dataset=...)`, the whole run (its forward pass, the LRP pass, the file). Zennit: a forward
pass for the target, then `Gradient(model, EpsilonPlusFlat(canonizers=[ResNetCanonizer()]))`
on each batch, one-hot × logit at the output (Zennit's own example), into h5py. The goal
(issue 45) is hookrun ≥ 1.2× Zennit's images/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision

from hookrun.stages.derive.lrp.method import LRP  # noqa: F401  (hookrun's side is importable)


def _setup(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    images = torch.randn(
        args.count, 3, args.size, args.size, generator=torch.Generator().manual_seed(1)
    )
    return model, images


def _hookrun(args: argparse.Namespace, out: Path) -> float:
    import hookrun

    model, images = _setup(args)
    overrides = ["experiment=lrp", "derive.lrp.composite=epsilon_plus_flat", "~hooks.photo"]
    overrides += [f"batch_size={args.batch}", "render=false", "progress=false"]
    start = time.perf_counter()
    hookrun.run(overrides, model=model, dataset=list(images), run_dir=out)
    return time.perf_counter() - start


def _zennit(args: argparse.Namespace, out: Path) -> float:
    import h5py
    from zennit.attribution import Gradient
    from zennit.composites import EpsilonPlusFlat
    from zennit.torchvision import ResNetCanonizer

    model, images = _setup(args)
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    with h5py.File(out / "zennit.h5", "w") as f:
        stored = f.create_dataset("relevance", shape=tuple(images.shape), dtype="float32")
        composite = EpsilonPlusFlat(canonizers=[ResNetCanonizer()])
        with Gradient(model, composite) as attributor:
            for first in range(0, args.count, args.batch):
                x = images[first : first + args.batch]
                with torch.no_grad():
                    target = model(x).argmax(1)
                _, relevance = attributor(
                    x, lambda o, t=target: torch.nn.functional.one_hot(t, o.shape[1]).to(o) * o
                )
                stored[first : first + len(x)] = relevance.numpy()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--side", choices=["hookrun", "zennit"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # one side, in a process of its own: its seconds as JSON
        with tempfile.TemporaryDirectory() as folder:
            run = _hookrun if args.side == "hookrun" else _zennit
            print(json.dumps({"seconds": run(args, Path(folder) / "run")}))
        return
    seconds: dict[str, list[float]] = {"hookrun": [], "zennit": []}
    base = [sys.executable, __file__, "--count", str(args.count), "--size", str(args.size)]
    base += ["--batch", str(args.batch)]
    for rep in range(args.reps):
        # Interleaved, the side that goes first alternating: a load that drifts hits both.
        order = ["hookrun", "zennit"] if rep % 2 == 0 else ["zennit", "hookrun"]
        for side in order:
            done = subprocess.run(
                [*base, "--side", side], capture_output=True, text=True, check=True
            )
            seconds[side].append(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])
            print(f"rep {rep} {side}: {seconds[side][-1]:.2f} s", flush=True)
    rate = {side: args.count / statistics.median(s) for side, s in seconds.items()}
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(
        f"ResNet-18 (random), {args.count} images of {args.size} px, batch {args.batch}, "
        f"median of {args.reps}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"hookrun {rate['hookrun']:.2f} img/s, zennit {rate['zennit']:.2f} img/s, ratio "
          f"{rate['hookrun'] / rate['zennit']:.2f}x (goal >= 1.2x)")  # fmt: skip
    print(f"load: {load}")


if __name__ == "__main__":
    main()
