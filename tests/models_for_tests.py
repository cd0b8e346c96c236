"""Small models for tests, importable by `model._target_=models_for_tests.<Name>`."""

from __future__ import annotations

import torch
from torch import nn

# Every instance built, so tests can inspect a model after the runner is done with it.
BUILT: list[nn.Module] = []


class TwiceNet(nn.Module):
    """One Linear and one in-place ReLU, each called twice: fc(relu(fc(x))) then relu."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.fc = nn.Linear(width, width)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(width, 3)
        BUILT.append(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.relu(self.fc(self.relu(self.fc(x)))))


class ResidualNet(nn.Module):
    """y = head(relu(x) + x): the ReLU's input is also used by the skip connection."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.pre = nn.Linear(width, width)
        self.relu = nn.ReLU()
        self.head = nn.Linear(width, 2)
        BUILT.append(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        return self.head(self.relu(h) + h)


class ExplodingNet(TwiceNet):
    """TwiceNet that raises in the forward pass of its second batch."""

    def __init__(self, width: int = 4) -> None:
        super().__init__(width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Counted in gradient mode only: the probes (no_grad) come before any batch.
        self.calls += torch.is_grad_enabled()
        if self.calls == 2:
            raise RuntimeError("boom in batch 2")
        return super().forward(x)


class WatchedConvNet(nn.Module):
    """A small conv net (ends in global average pooling + one linear layer) that records,
    on every forward pass, whether any parameter required grad at that moment."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(inplace=True),
        )
        self.fc = nn.Linear(8, 4)
        self.forwards: list[bool] = []
        self.deterministic: list[bool] = []  # torch's determinism switch at each forward
        BUILT.append(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards.append(any(p.requires_grad for p in self.parameters()))
        self.deterministic.append(torch.are_deterministic_algorithms_enabled())
        return self.fc(self.features(x).mean(dim=(2, 3)))
