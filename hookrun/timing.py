"""`profile=true`: time per stage of a run, so a user sees which stage bounds it.

Stages: data (waiting for the next batch), forward, backward, copy (device → host copies of
captures, inside forward/backward), derive, queue wait (the producer blocked on a full
writer queue) and write (the writer thread; it overlaps everything else). On CUDA each
stage synchronises the device, which costs some overlap: profile, then run without it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["STAGES", "StageTimer"]

STAGES = ("data", "forward", "backward", "copy", "derive", "evaluate", "queue wait", "write")


class StageTimer:
    """Adds up seconds per stage; does nothing (and costs nothing) when disabled."""

    def __init__(self, enabled: bool, device: torch.device | None = None) -> None:
        self.enabled = enabled
        self.sync = enabled and device is not None and device.type == "cuda"
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - start

    def report(self, wall: float) -> str:
        """A table of the stages, with their share of the run's wall time."""
        lines = ["profile (seconds, share of wall time; write overlaps the other stages):"]
        for name in STAGES:
            if name in self.seconds:
                secs = self.seconds[name]
                lines.append(f"  {name:<11} {secs:8.3f} s  {100 * secs / max(wall, 1e-9):5.1f}%")
        lines.append(f"  {'wall':<11} {wall:8.3f} s")
        return "\n".join(lines)
