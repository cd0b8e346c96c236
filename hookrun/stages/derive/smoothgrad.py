"""SmoothGrad (Smilkov et al. 2017): the input gradient of the target score averaged over
`samples` noisy copies x + ε, ε ~ N(0, (sigma · (max x − min x))²) per sample; `squared`
averages the squared gradients instead (SmoothGrad-squared, Hooker et al. 2019).

`derive.smoothgrad`: samples (25), sigma (0.15, a fraction of each sample's value range; 0
gives exactly the plain input gradient), squared (false), internal_batch_size (rows per
extra pass; null: as many as 8M input values allow, 682 rows of 3×64×64, 55 of
3×224×224). The noise comes from a generator seeded by (run seed,
"smoothgrad", the batch's first row): draw s is one `randn` of the batch's shape, in order.

Result: /derived/smoothgrad/input, the input's shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.stages.derive.bounds import check_rows_per_pass
from hookrun.stages.derive.gradients import input_gradient, rows_per_pass
from hookrun.stages.derive.registry import BatchContext, Method, register_method
from hookrun.typed import Frozen

__all__ = ["SmoothGrad", "SmoothGradArgs"]


@dataclass
class SmoothGradArgs(Frozen):
    samples: int = 25
    """Noisy copies of each input whose gradients are averaged."""
    sigma: float = 0.15
    """Noise standard deviation, as a fraction of the input's value range."""
    squared: bool = False
    """Average the squared gradients (SmoothGrad-Squared) instead of the gradients."""
    internal_batch_size: int | None = None
    """Rows per extra forward/backward pass; null: by input size (stages/derive/gradients.py)."""


@register_method("smoothgrad")
class SmoothGrad(Method):
    Args = SmoothGradArgs
    runs_passes = True
    # On token data: the input embeddings (BatchContext.explained), results (N, T, D).
    tokens_ok = explains_input = True

    @classmethod
    def check(cls, args: SmoothGradArgs, key: str) -> None:
        if args.samples < 1:
            raise HookrunError(f"{key}.samples: {args.samples} is out of range; valid: >= 1")
        if not args.sigma >= 0:
            raise HookrunError(f"{key}.sigma: {args.sigma} is negative; valid: >= 0")
        if not math.isfinite(args.sigma):  # infinite noise: every gradient NaN
            raise HookrunError(f"{key}.sigma: {args.sigma}; valid: a finite number >= 0")
        check_rows_per_pass(key, args.internal_batch_size)

    def requires(self, args: SmoothGradArgs) -> list[str]:
        return []

    def extra_rows(self, args: SmoothGradArgs, state: None, sample: tuple[int, ...]) -> tuple:
        return args.samples, sample  # one noisy copy per draw per row

    def passes(
        self, args: SmoothGradArgs, state: None, batch: BatchContext
    ) -> dict[str, torch.Tensor]:
        x = batch.explained().detach()
        key = layout.derived_key(self.name, "input")
        every = torch.arange(len(x), device=x.device)
        if args.sigma == 0:  # no noise: every draw is the plain gradient, computed once
            grad = input_gradient(batch, x, every)
            return {key: (grad * grad if args.squared else grad).float().cpu()}
        n = len(x)
        flat = x.flatten(1)
        sd = (args.sigma * (flat.max(1).values - flat.min(1).values)).view(
            -1, *(1,) * (x.dim() - 1)
        )
        gen = batch.generator(self.name)
        total = torch.zeros_like(x)
        draws = max(1, rows_per_pass(args.internal_batch_size, x) // n)
        for start in range(0, args.samples, draws):
            count = min(draws, args.samples - start)
            # One draw at a time, so the noise does not depend on internal_batch_size.
            noise = torch.stack(
                [
                    torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)
                    for _ in range(count)
                ]
            )
            points = (x + sd * noise).flatten(0, 1)  # (count · N, ...), draw-major
            grad = input_gradient(batch, points, every.repeat(count)).view(count, *x.shape)
            total += (grad * grad if args.squared else grad).sum(0)
        return {key: (total / args.samples).float().cpu()}
