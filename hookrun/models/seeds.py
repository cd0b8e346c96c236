"""The models hookrun ships: the seed tutorials' hand-set MLP and conv net, and a small CNN
trained on scikit-learn's digits. Chosen by `model.name`; `SEED_MODELS` lists them."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SeedMLP", "SeedConvNet", "DigitsCNN", "SEED_MODELS"]


class SeedMLP(nn.Module):
    """The seed tutorial's MLP (tests/seeds/000) with its hand-set weights (input: 3 numbers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc1.weight.copy_(
                torch.tensor([[1.0, 2, 3], [-4, -5, -6], [7, 8, 9], [-10, -11, -12]])
            )
            self.fc1.bias.copy_(torch.tensor([1.0, 2, 3, 4]))
            self.fc2.weight.copy_(torch.tensor([[1.0, 2, 3, 4]]))
            self.fc2.bias.copy_(torch.tensor([1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu1(self.fc1(x)))


class SeedConvNet(nn.Module):
    """The seed tutorial's conv net (tests/seeds/001-002): kernels of ones and twos, then a
    2x2 max pool."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3)
        self.pool1 = nn.MaxPool2d(2, 2)
        with torch.no_grad():
            self.conv1.weight[0].fill_(1.0)
            self.conv1.weight[1].fill_(2.0)
            self.conv1.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool1(self.conv1(x))


class DigitsCNN(nn.Module):
    """A small CNN for scikit-learn's 8x8 digits; ends in global average pooling + one
    linear layer, so CAM applies. Trained by scripts/train_digits.py."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(inplace=True),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


SEED_MODELS: dict[str, type[nn.Module]] = {
    "seed_mlp": SeedMLP,
    "seed_convnet": SeedConvNet,
    "digits_cnn": DigitsCNN,
}
