"""ROAD (Rong et al. 2022, remove and debias): the target's probability after the most
relevant (MoRF) or the least relevant (LeRF) pixels are removed and imputed by noisy linear
imputation (stages/evaluate/impute.py), for each fraction r of `fractions`.

MoRF removes the round(r·H·W) most relevant pixels, LeRF the round(r·H·W) least relevant.
The noise (std `noise`, in the model's input space) comes from a CPU generator seeded by
(run seed, "road|<attribution path>", the batch's first row); for each direction (MoRF,
then LeRF) and each fraction in order, one standard normal draw of the batch's shape
(N, C, H, W), of which the removed pixels are used. Stored: /evaluate/road_morf/<…> and
/evaluate/road_lerf/<…> (N, len(fractions)), attribute `fractions`, and
/evaluate/road/<…>.score (N,) = (mean over fractions of LeRF − mean of MoRF) / 2: higher is
more faithful (removing the least relevant pixels should hurt less than the most relevant).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hookrun.errors import HookrunError
from hookrun.stages.evaluate.impute import noisy_linear_imputation
from hookrun.stages.evaluate.keys import FRACTIONS, SCORE_SUFFIX, evaluate_key
from hookrun.stages.evaluate.registry import (
    EvalBatch,
    FaithfulnessMetric,
    Stored,
    register_faithfulness_metric,
    target_probabilities,
)
from hookrun.stages.evaluate.relevance import pixel_ranks
from hookrun.typed import Frozen

__all__ = ["RoadArgs", "Road", "removed_counts", "DIRECTIONS"]

# (dataset name, whether the most relevant pixels are removed), in the order rows are drawn.
DIRECTIONS = (("road_morf", True), ("road_lerf", False))


@dataclass
class RoadArgs(Frozen):
    fractions: list[float] = field(default_factory=lambda: [k / 10 for k in range(1, 10)])
    """The fractions of pixels removed, most relevant first (MoRF) and least relevant first
    (LeRF).
    """
    noise: float = 0.01
    """Standard deviation of the noise added to each imputed pixel."""


def removed_counts(fractions: list[float], pixels: int) -> list[int]:
    """round(r·pixels) for each fraction r (halves to even)."""
    return [round(r * pixels) for r in fractions]


class _Draws:
    """The standard normal draws of one batch, block (direction, fraction) by block, in
    order: the same numbers however the rows are cut into forward passes."""

    def __init__(self, generator: torch.Generator, shape: torch.Size) -> None:
        self.generator, self.shape = generator, shape
        self.blocks: dict[int, torch.Tensor] = {}
        self.drawn = 0

    def block(self, index: int) -> torch.Tensor:
        while self.drawn <= index:
            self.blocks[self.drawn] = torch.randn(self.shape, generator=self.generator)
            self.blocks.pop(self.drawn - 2, None)  # rows are asked for in order
            self.drawn += 1
        return self.blocks[index]


@register_faithfulness_metric("road")
class Road(FaithfulnessMetric):
    Args = RoadArgs
    summary_suffix = SCORE_SUFFIX

    @classmethod
    def check(cls, args: RoadArgs, key: str) -> None:
        if not args.fractions:
            raise HookrunError(f"{key}.fractions: [] is empty; valid: fractions in [0, 1)")
        for r in args.fractions:
            if not 0 <= r < 1:
                raise HookrunError(
                    f"{key}.fractions: {r} is out of range; valid: fractions in [0, 1) (all "
                    "pixels removed leave nothing to impute from)"
                )
        if not (math.isfinite(args.noise) and args.noise >= 0):
            raise HookrunError(f"{key}.noise: {args.noise}; valid: a number >= 0")

    @classmethod
    def check_image(cls, args: RoadArgs, key: str, image: tuple[int, int]) -> None:
        # Each fraction is two perturbed images per sample (MoRF, LeRF), imputed by a
        # solver over the image: more fractions than pixels only repeat removed counts.
        pixels = image[0] * image[1]
        if len(args.fractions) > pixels:
            raise HookrunError(
                f"{key}.fractions: {len(args.fractions)} fractions, more than the {pixels} "
                f"pixels of a {image[0]}x{image[1]} input; valid: at most {pixels} fractions"
            )

    def summary_key(self, attribution: str) -> str:
        return evaluate_key(self.name, attribution, SCORE_SUFFIX)

    def stored(self, args: RoadArgs, attribution: str, image: tuple[int, int]) -> dict[str, Stored]:
        pixels = image[0] * image[1]
        fractions = [c / pixels for c in removed_counts(list(args.fractions), pixels)]
        out = {
            evaluate_key(name, attribution): Stored((len(args.fractions),), {FRACTIONS: fractions})
            for name, _ in DIRECTIONS
        }
        out[self.summary_key(attribution)] = Stored((), {})
        return out

    def evaluate(
        self, args: RoadArgs, batch: EvalBatch, attribution: str
    ) -> dict[str, torch.Tensor]:
        x = batch.inputs
        n, (h, w), k = len(x), x.shape[-2:], len(args.fractions)
        ranks = pixel_ranks(batch.relevance[attribution])  # on the host, like the solver
        counts = torch.tensor(removed_counts(list(args.fractions), h * w))
        draws = _Draws(batch.generator(f"road|{attribution}"), x.shape)
        host = x.detach().cpu()
        images = _imputed(args, host, ranks, counts, draws, x.device)
        probs = target_probabilities(batch, 2 * k * n, images).view(2, k, n)
        morf, lerf = probs[0].T.contiguous(), probs[1].T.contiguous()
        score = (lerf.double().mean(1) - morf.double().mean(1)) / 2
        return {
            evaluate_key("road_morf", attribution): morf,
            evaluate_key("road_lerf", attribution): lerf,
            self.summary_key(attribution): score.float(),
        }


def _imputed(
    args: RoadArgs,
    x: torch.Tensor,
    ranks: torch.Tensor,
    counts: torch.Tensor,
    draws: _Draws,
    device: torch.device,
) -> Callable[[slice], tuple[torch.Tensor, torch.Tensor]]:
    """The rows (direction, fraction, sample) of one forward pass, imputed on the host
    (`x`), then on `device` for the model."""
    n, pixels, k = len(x), ranks.shape[1], len(counts)

    def images(chunk: slice) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(chunk.start, chunk.stop)
        block, sample = rows // n, rows % n
        most = block < k  # MoRF rows first, then LeRF
        count = counts[block % k, None]
        removed = torch.where(most[:, None], ranks[sample] < count, ranks[sample] >= pixels - count)
        noise = torch.stack(
            [draws.block(int(b))[int(i)] for b, i in zip(block, sample, strict=True)]
        )
        out = noisy_linear_imputation(x[sample], removed.view(-1, *x.shape[-2:]), args.noise, noise)
        return out.to(device, x.dtype), sample

    return images
