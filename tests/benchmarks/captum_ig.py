"""Captum's IntegratedGradients as a whole process, the way its docs show it, writing its
attributions to HDF5 like hookrun does — the other side of run.py's IG comparison.

    python tests/benchmarks/captum_ig.py OUT.h5 [--count 32] [--size 64] [--batch 8] [--steps 32]

ResNet-18 with seeded random weights (speed does not depend on the values), random images
of the same shape as hookrun's fake dataset, the predicted class as the target.
"""

from __future__ import annotations

import argparse

import h5py
import torch
import torchvision
from captum.attr import IntegratedGradients


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval().to(device)
    images = torch.randn(args.count, 3, args.size, args.size)
    ig = IntegratedGradients(model)
    shape = (args.count, 3, args.size, args.size)
    with h5py.File(args.out, "w") as f:
        out = f.create_dataset("attributions", shape=shape, dtype="float32")
        for start in range(0, args.count, args.batch):
            x = images[start : start + args.batch].to(device)
            with torch.no_grad():
                target = model(x).argmax(dim=1)
            attr = ig.attribute(x, target=target, n_steps=args.steps)
            out[start : start + len(x)] = attr.detach().cpu().numpy()


if __name__ == "__main__":
    main()
