"""Models for runs that a signal meets where no Python runs, importable by
`model._target_=stall_models.<Name>` (tests/ is on the path of a spawned run)."""

from __future__ import annotations

import os
import time

import torch
from models_for_tests import TwiceNet


class BackwardStallNet(TwiceNet):
    """TwiceNet whose forward pass number `stall_at` in gradient mode (the probes come
    first, without), while the file `stall_flag` exists, also builds `stall_s` seconds of
    cumulative products on its input; the flag is removed as the backward pass reaches
    them. Their backward is one C++ call of about five times as long (cumprod's gradient
    where the input holds zeros), in which no Python runs unless a hook does. Their sum
    enters the output times zero: the numbers are the plain TwiceNet's (and that batch is
    dropped anyway when a signal stops it). A later process, with the flag gone, runs at
    full speed."""

    def __init__(self, width: int = 4, stall_flag: str = "", stall_at: int = 2, stall_s: float = 6):
        super().__init__(width)
        self.stall_flag, self.stall_at, self.stall_s = stall_flag, stall_at, stall_s
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.calls += torch.is_grad_enabled()
        if self.calls != self.stall_at or not os.path.exists(self.stall_flag):
            return out
        # Small blocks (a tenth of a second each, at most, on a busy core): the checks in
        # the backward pass come between two of them.
        zeros = torch.rand(200, 2000, generator=torch.Generator().manual_seed(0))
        zeros[zeros < 0.05] = 0
        h = x.sum() * 1e-3 + zeros
        end = time.monotonic() + self.stall_s
        while time.monotonic() < end:
            h = torch.cumprod(zeros + h * 1e-3, 1)  # bounded: each factor is below 1.001
        total = h.sum()
        # The flag goes when the backward pass reaches the products (the hook is its last
        # Python until the input's gradient).
        total.register_hook(lambda grad: os.unlink(self.stall_flag))
        return out + 0 * total
