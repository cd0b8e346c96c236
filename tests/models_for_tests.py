"""Small models for tests, importable by `model._target_=models_for_tests.<Name>`."""

from __future__ import annotations

import os
import time

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


class StallingNet(TwiceNet):
    """TwiceNet whose batch `stall_at` (its forward pass of that number in gradient mode: the
    probes come first, without) takes ten minutes of small torch operations — a long batch,
    with Python running between them — while the file `stall_flag` exists; the flag is
    removed as the stall starts, so a later process runs at full speed."""

    def __init__(self, width: int = 4, stall_flag: str = "", stall_at: int = 3) -> None:
        super().__init__(width)
        self.stall_flag, self.stall_at = stall_flag, stall_at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += torch.is_grad_enabled()
        if self.calls == self.stall_at and os.path.exists(self.stall_flag):
            os.unlink(self.stall_flag)
            end, y = time.monotonic() + 600, x.detach()
            while time.monotonic() < end:
                y = torch.tanh(y)
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


class BiasTable(nn.Module):
    """Returns the same (3, 5) table whatever the batch (as a relative-position bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(3, 5))

    def forward(self) -> torch.Tensor:
        return self.table * 2.0


class Windows(nn.Module):
    """Cuts (N, C, H, W) into 2x2 windows folded into the batch axis: (N * 4, H/2 * W/2, C),
    sample by sample (as torchvision's Swin), or window by window with `window_major`."""

    def __init__(self, window_major: bool = False) -> None:
        super().__init__()
        self.window_major = window_major

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        x = x.view(n, c, 2, h // 2, 2, w // 2).permute(0, 2, 4, 3, 5, 1)  # N, 2, 2, h, w, C
        x = x.reshape(n, 4, (h // 2) * (w // 2), c)
        if self.window_major:
            x = x.transpose(0, 1)
        return x.reshape(n * 4, (h // 2) * (w // 2), c)


class WindowNet(nn.Module):
    """A conv, windows folded into the batch axis, a Linear on each window token, and a bias
    table added to the logits: every row layout the probe tells apart."""

    def __init__(self, window_major: bool = False) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.windows = Windows(window_major)
        self.proj = nn.Linear(4, 6)
        self.bias = BiasTable()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = torch.relu(self.proj(self.windows(self.conv(x))))  # (N * 4, L, 6)
        pooled = tokens.mean(dim=1)
        if self.windows.window_major:
            pooled = pooled.view(4, x.shape[0], 6).mean(dim=0)
        else:
            pooled = pooled.view(x.shape[0], 4, 6).mean(dim=1)
        return self.head(pooled) + self.bias()[0, :3]
