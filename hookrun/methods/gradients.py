"""The one pass that integrated gradients and SmoothGrad repeat: the gradient of each row's
target score with respect to a batch of model inputs (the run's hooks stand aside)."""

from __future__ import annotations

import torch

from hookrun.methods.registry import BatchContext

__all__ = ["input_gradient", "rows_per_pass"]


def input_gradient(
    batch: BatchContext, points: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """∂ score(model(points))_i / ∂ points_i for every row i (rows do not interact in eval
    mode, so one backward from the sum gives each row its own gradient)."""
    points = points.detach().requires_grad_(True)
    with torch.enable_grad():
        score = batch.score(batch.model(points), targets)
        (grad,) = torch.autograd.grad(score.sum(), points)
    return grad


def rows_per_pass(internal_batch_size: int | None, batch_rows: int) -> int:
    """How many rows one extra forward/backward pass takes: `internal_batch_size`, or one
    batch's worth when it is null (the memory the run's own backward pass needs)."""
    return internal_batch_size or batch_rows
