"""The one pass that integrated gradients and SmoothGrad repeat: the gradient of each row's
target score with respect to a batch of model inputs (the run's hooks stand aside)."""

from __future__ import annotations

import torch

from hookrun.stages.derive.registry import BatchContext

__all__ = ["input_gradient", "rows_per_pass"]


def input_gradient(batch: BatchContext, points: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """∂ score(model(points))_i / ∂ points_i for every row i, row i standing for batch row
    sample[i] (its target; rows do not interact in eval mode, so one backward from the sum
    gives each row its own gradient)."""
    points = points.detach().requires_grad_(True)
    with torch.enable_grad():
        score = batch.score(batch.run(points, sample), batch.targets[sample])
        (grad,) = torch.autograd.grad(score.sum(), points)
    return grad


# internal_batch_size=null: rows per extra pass up to this many input values (32 MiB of
# float32 input: 682 rows of 3x64x64, 55 rows of 3x224x224). Small passes are slow on a busy
# CPU (64-row passes took 1.5x the time of 256-row ones on 2 shared cores), large ones cost
# memory in proportion to the input.
AUTO_INPUT_VALUES = 1 << 23


def rows_per_pass(internal_batch_size: int | None, inputs: torch.Tensor) -> int:
    """How many rows one extra forward/backward pass takes: `internal_batch_size`, or as
    many as AUTO_INPUT_VALUES allows when it is null (at least one)."""
    if internal_batch_size:
        return internal_batch_size
    return max(1, AUTO_INPUT_VALUES // max(1, inputs[0].numel()))
