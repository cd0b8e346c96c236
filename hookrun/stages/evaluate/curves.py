"""Deletion and insertion (Petsiuk et al. 2018, RISE): the target's probability as the most
relevant pixels are taken away (deletion) or given back (insertion).

At step k of `steps`, the round(k·H·W/steps) most relevant pixels (all channels) are
replaced by the baseline's (deletion), or the baseline gets them back from the image
(insertion). Baselines live in the model's input space: `zeros`, `blur`
(torchvision's gaussian_blur(x, 11, 5.0)) and `mean` (each channel's mean over the image).
Stored: the curve /evaluate/<deletion|insertion>/<attribution> (N, steps + 1), attribute
`fractions` (the pixels perturbed at each column / H·W), and `<…>.auc` (N,) by the trapezoid
rule over those fractions.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from hookrun.errors import HookrunError
from hookrun.stages.evaluate.keys import AUC_SUFFIX, FRACTIONS, evaluate_key
from hookrun.stages.evaluate.registry import (
    EvalBatch,
    FaithfulnessMetric,
    Stored,
    register_faithfulness_metric,
    target_probabilities,
)
from hookrun.stages.evaluate.relevance import pixel_ranks
from hookrun.typed import Frozen

__all__ = ["BASELINES", "DeletionArgs", "InsertionArgs", "pixel_counts", "baseline_image"]

BASELINES = ("zeros", "blur", "mean")


@dataclass
class DeletionArgs(Frozen):
    steps: int = 20
    """Points on the curve: the fraction of pixels removed goes from 0 to 1 in this many steps."""
    baseline: str = "zeros"
    """zeros | blur | mean"""


@dataclass
class InsertionArgs(Frozen):
    steps: int = 20
    """Points on the curve: the fraction of pixels inserted goes from 0 to 1 in this many steps."""
    baseline: str = "blur"
    """zeros | blur | mean"""


def pixel_counts(steps: int, pixels: int) -> list[int]:
    """round(k·pixels/steps) for k = 0 … steps, rounding halves to even (exactly)."""
    return [round(Fraction(k * pixels, steps)) for k in range(steps + 1)]


def baseline_image(baseline: str, x: torch.Tensor) -> torch.Tensor:
    """The image each pixel is taken from when it is not the photo's, (N, C, H, W)."""
    if baseline == "zeros":
        return torch.zeros_like(x)
    if baseline == "blur":
        from torchvision.transforms.functional import gaussian_blur  # with an image run only

        return gaussian_blur(x, [11, 11], [5.0, 5.0])
    return x.mean(dim=(2, 3), keepdim=True).expand_as(x)  # mean: each channel's, per image


class _Curve(FaithfulnessMetric):
    summary_suffix = AUC_SUFFIX
    removes = True  # deletion: the most relevant pixels go; insertion: they come back

    @classmethod
    def check(cls, args: DeletionArgs, key: str) -> None:
        if args.steps < 1:
            raise HookrunError(f"{key}.steps: {args.steps} is out of range; valid: >= 1")
        if args.baseline not in BASELINES:
            raise HookrunError(f"{key}.baseline: {args.baseline!r}; valid: {', '.join(BASELINES)}")

    @classmethod
    def check_image(cls, args: DeletionArgs, key: str, image: tuple[int, int]) -> None:
        # Past one pixel a step, steps repeat: a column that perturbs nothing new, and a
        # curve (and its pixel counts) as long as the number asked for.
        pixels = image[0] * image[1]
        if args.steps > pixels:
            raise HookrunError(
                f"{key}.steps: {args.steps} is more than the {pixels} pixels of a "
                f"{image[0]}x{image[1]} input (a step perturbs at least one); valid: 1 to {pixels}"
            )

    def summary_key(self, attribution: str) -> str:
        return evaluate_key(self.name, attribution, AUC_SUFFIX)

    def stored(
        self, args: DeletionArgs, attribution: str, image: tuple[int, int]
    ) -> dict[str, Stored]:
        pixels = image[0] * image[1]
        fractions = [c / pixels for c in pixel_counts(args.steps, pixels)]
        return {
            evaluate_key(self.name, attribution): Stored((args.steps + 1,), {FRACTIONS: fractions}),
            self.summary_key(attribution): Stored((), {}),
        }

    def evaluate(
        self, args: DeletionArgs, batch: EvalBatch, attribution: str
    ) -> dict[str, torch.Tensor]:
        x = batch.inputs
        n, (h, w), columns = len(x), x.shape[-2:], args.steps + 1
        ranks = pixel_ranks(batch.relevance[attribution]).to(x.device)
        counts = torch.tensor(pixel_counts(args.steps, h * w), device=x.device)
        base = baseline_image(args.baseline, x)
        # Where a pixel is perturbed, the image comes from `later`, elsewhere from `first`.
        first, later = (x, base) if self.removes else (base, x)

        def images(chunk: slice) -> tuple[torch.Tensor, torch.Tensor]:
            rows = torch.arange(chunk.start, chunk.stop, device=x.device)
            sample, step = rows // columns, rows % columns
            mask = (ranks[sample] < counts[step, None]).view(-1, 1, h, w)
            return torch.where(mask, later[sample], first[sample]), sample

        curve = target_probabilities(batch, n * columns, images).view(n, columns)
        fractions = counts.cpu().double() / (h * w)
        auc = torch.trapezoid(curve.double(), fractions, dim=1)
        return {
            evaluate_key(self.name, attribution): curve,
            self.summary_key(attribution): auc.float(),
        }


@register_faithfulness_metric("deletion")
class Deletion(_Curve):
    Args = DeletionArgs
    higher_is_better = False  # a faithful map loses the class fast


@register_faithfulness_metric("insertion")
class Insertion(_Curve):
    Args = InsertionArgs
    removes = False
