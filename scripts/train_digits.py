"""Train hookrun's `digits_cnn` preset on scikit-learn's digits (train split) in seconds.

    python scripts/train_digits.py [--out hookrun/models/checkpoints/digits_cnn.pt]

Deterministic (fixed seed, CPU, one thread); prints the test accuracy, which the test
suite requires to be at least 95%.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from hookrun.data.kinds import Digits, DigitsDatasetConfig
from hookrun.models.seeds import DigitsCNN

OUT = Path(__file__).resolve().parents[1] / "hookrun" / "models" / "checkpoints" / "digits_cnn.pt"


def accuracy(model: nn.Module, data: Digits) -> float:
    model.eval()
    with torch.no_grad():
        predicted = model(data.images).argmax(dim=1)
    return float((predicted == torch.tensor(data.labels)).float().mean())


def train(epochs: int = 30, seed: int = 0) -> tuple[DigitsCNN, float]:
    # One thread: the same numbers on every machine with the same torch. The caller's count
    # comes back after (the test suite calls this in a process whose later runs compare
    # their bytes with a subprocess's, which a count left at 1 changed).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(epochs, seed)
    finally:
        torch.set_num_threads(threads)


def _train(epochs: int, seed: int) -> tuple[DigitsCNN, float]:
    torch.manual_seed(seed)
    train_set = Digits(DigitsDatasetConfig(split="train"))
    test_set = Digits(DigitsDatasetConfig(split="test"))
    model = DigitsCNN()
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    labels = torch.tensor(train_set.labels)
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(labels))
        for batch in order.split(64):
            optimiser.zero_grad()
            loss = nn.functional.cross_entropy(model(train_set.images[batch]), labels[batch])
            loss.backward()
            optimiser.step()
    return model, accuracy(model, test_set)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--epochs", type=int, default=30)
    args = parser.parse_args()
    model, acc = train(args.epochs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.out)
    print(f"test accuracy {acc:.4f}; weights saved to {args.out}")


if __name__ == "__main__":
    main()
