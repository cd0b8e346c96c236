"""A training job's ranks under torchrun: data parallel, the same steps as one process.

Every rank holds the same dictionaries (the same initial draws, the same reduced gradients,
the same Adam: the same bits on every rank) and steps on its own contiguous slice of each
step's global batch (`part`). What one process computes over the whole batch is computed
here from every rank's part, summed across the ranks (`sum_`), before it is used: the
gradients, the latents' firing counts, batchtopk's selection over the whole batch and its
threshold's minimum (`min_`), the logged metrics. The process group is the one the
pipeline joined (scale/distributed.py's `start`); this module only uses it.

A signal reaches the ranks at different moments: they stop together, at the same step
(`agreed_stop`), so no rank waits in a collective for a peer that left.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from hookrun.errors import HookrunError, Interrupted

__all__ = ["Ranks", "joined", "told"]

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's rank among `size` data-parallel ranks (the default process group)."""

    rank: int
    size: int

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes (checkpoints, the run's file, the saved folders)."""
        return self.rank == 0

    def part(self, batch: int) -> slice:
        """This rank's contiguous slice of a global batch of `batch` tokens."""
        share = batch // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def sum_(self, t: Tensor) -> Tensor:
        """`t` summed over the ranks, in place (returned)."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def min_(self, t: Tensor) -> Tensor:
        """`t`'s minimum over the ranks, in place (returned)."""
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t

    def sum_grads(self, params: list[torch.nn.Parameter], counts: Tensor, most: int) -> Tensor:
        """Every parameter's gradient summed over the ranks, in place, and `counts` (int64,
        each at most `most` once summed) summed, returned: one collective for all (each
        costs about a millisecond of latency on two CPU ranks, as much as the sum itself)."""
        for p in params:
            if p.grad is None:  # a parameter no term reached on this step: zero, as summed
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        dtype = grads[0].dtype
        # counts ride along as floats where the dtype holds them exactly (float32: to 2^24);
        # `most` is the same on every rank, so is the choice
        exact = most <= {torch.float32: 2**24, torch.float64: 2**53}.get(dtype, 0)
        parts = [g.reshape(-1) for g in grads] + ([counts.to(dtype)] if exact else [])
        flat = self.sum_(torch.cat(parts))
        at = 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()
        if not exact:
            return self.sum_(counts.clone())
        return flat[at:].round().to(counts.dtype)

    def gather(self, t: Tensor) -> Tensor:
        """Every rank's `t` (of the same shape on each), concatenated in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def gather_uneven(self, t: Tensor) -> list[Tensor]:
        """Every rank's `t` (rows may differ in number, the rest of the shape not), a
        tensor per rank: padded to the longest for the collective, then cut back."""
        rows = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
        counts = self.gather(rows).tolist()
        longest = max(counts)
        padded = t.new_zeros((longest, *t.shape[1:]))
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        return [p[:n] for p, n in zip(parts, counts, strict=True)]

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether `flag` is true on any rank."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def any_async(self, flag: bool, device: torch.device) -> tuple[Any, Tensor]:
        """`any` begun: (its work, the flag tensor), true on every rank after work.wait()
        where it was on any."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
        return dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), t

    def agreed_stop(self, stopped: Interrupted | None, device: torch.device) -> None:
        """Raise Interrupted on every rank when any rank was stopped by a signal (this
        rank's own `stopped` where it was one of them)."""
        if self.any(stopped is not None, device):
            raise stopped or told()

    def from_main(self, work: Callable[[], T]) -> T:
        """`work()` run by rank 0 only, its result (or its HookrunError, raised on every
        rank) given to every rank: a check whose answer may change while the ranks make it
        (a file rank 0 is about to write) is made once."""
        said: list[Any] = [None, None]
        if self.main:
            try:
                said[0] = work()
            except HookrunError as err:
                said[1] = str(err)
        dist.broadcast_object_list(said, src=0)
        if said[1] is not None:
            raise HookrunError(said[1])
        return said[0]

    def barrier(self) -> None:
        dist.barrier()


def told() -> Interrupted:
    """What stops a rank that no signal reached: another rank was signalled."""
    return Interrupted(
        "interrupted: another rank of the torchrun job was signalled", signal.SIGTERM
    )


def joined() -> Ranks | None:
    """The ranks of this torchrun job, or None for one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    return Ranks(dist.get_rank(), dist.get_world_size())
