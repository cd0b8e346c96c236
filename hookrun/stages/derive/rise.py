"""RISE (Petsiuk et al. 2018), a perturbation method without gradients (perturb.py's batched
scoring): `masks` random masks, each a `cells` × `cells` grid of cells kept with
probability `p`, upsampled bilinearly to (cells + 1) × the cell size and cropped at a random
shift; the map is Σ_i P(target | x ⊙ M_i) M_i / (masks · p), P the target's softmax
probability as in the paper.

The masks are drawn from the batch's generator (BatchContext.generator("rise")): one
`torch.rand((masks, cells, cells))` < p, then the shifts `torch.randint(cell_h, (masks,))`
and `torch.randint(cell_w, (masks,))`. What draws them is stored beside each row's map, from
which `masks_from` makes them again exactly: /derived/rise/input.mask_cells (N, masks,
cells, cells) uint8, the kept cells, and /derived/rise/input.mask_shifts (N, masks, 2) int32,
each mask's (dy, dx) — every row of a batch the batch's. (The masks themselves are masks × H
× W floats a batch: 400 MB at the defaults, 2000 times the map.)

Result: (H, W) per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.memory import check_fits
from hookrun.stages.derive.bounds import check_rows_per_pass
from hookrun.stages.derive.perturb import image_size, perturbation_rows, perturbed_scores
from hookrun.stages.derive.registry import BatchContext, Method, register_method
from hookrun.typed import Frozen

__all__ = ["Rise", "RiseArgs", "draw_masks", "masks_from", "CELLS_KEY", "SHIFTS_KEY"]

CELLS_KEY = layout.derived_key("rise", "input") + ".mask_cells"
SHIFTS_KEY = layout.derived_key("rise", "input") + ".mask_shifts"


@dataclass
class RiseArgs(Frozen):
    masks: int = 2000
    """Random masks per image; the map is their mean weighted by the score each one keeps."""
    cells: int = 7
    """Each mask is a cells x cells grid of kept or dropped cells, upsampled and shifted."""
    p: float = 0.5
    """Probability that a cell is kept."""
    internal_batch_size: int | None = None
    """Masked images per forward pass; null: by input size."""


def draw_masks(
    args: RiseArgs, size: tuple[int, int], gen: torch.Generator, device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The masks' kept cells (masks, cells, cells) bool and shifts (masks, 2) int64, drawn
    from `gen` in the module docstring's order."""
    h, w = size
    cell_h, cell_w = math.ceil(h / args.cells), math.ceil(w / args.cells)
    grid = torch.rand((args.masks, args.cells, args.cells), generator=gen, device=device) < args.p
    dy = torch.randint(cell_h, (args.masks,), generator=gen, device=device)
    dx = torch.randint(cell_w, (args.masks,), generator=gen, device=device)
    return grid, torch.stack([dy, dx], dim=1)


def masks_from(cells: torch.Tensor, shifts: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(masks, H, W) float masks of an (H, W) image from their kept cells (masks, cells,
    cells) and shifts (masks, 2) — what /derived/rise/input.mask_cells and .mask_shifts hold
    for a row: each grid upsampled bilinearly to (cells + 1) × the cell size, cropped at
    its shift."""
    h, w = size
    count, n = cells.shape[0], cells.shape[-1]
    cell_h, cell_w = math.ceil(h / n), math.ceil(w / n)
    up = F.interpolate(
        cells.float()[:, None],
        size=((n + 1) * cell_h, (n + 1) * cell_w),
        mode="bilinear",
        align_corners=False,
    )[:, 0]
    at = cells.device
    shifts = shifts.to(at, torch.int64)
    rows = shifts[:, :1] + torch.arange(h, device=at)[None]  # (masks, H)
    cols = shifts[:, 1:] + torch.arange(w, device=at)[None]  # (masks, W)
    every = torch.arange(count, device=at)[:, None, None]
    return up[every, rows[:, :, None], cols[:, None, :]]


@register_method("rise")
class Rise(Method):
    Args = RiseArgs
    runs_passes = True
    needs_class = True
    perturbs = "rise multiplies an image's pixels by random smooth masks"

    @classmethod
    def check(cls, args: RiseArgs, key: str) -> None:
        if args.masks < 1 or args.cells < 1:
            bad = "masks" if args.masks < 1 else "cells"
            raise HookrunError(f"{key}.{bad}: {getattr(args, bad)} is out of range; valid: >= 1")
        if not 0 < args.p <= 1:
            raise HookrunError(f"{key}.p: {args.p} is out of range; valid: 0 < p <= 1")
        check_rows_per_pass(key, args.internal_batch_size)

    def requires(self, args: RiseArgs) -> list[str]:
        return []

    def prepare(self, args: RiseArgs, model: Any, sample: torch.Tensor) -> tuple[int, int]:
        size = image_size(tuple(sample.shape), f"derive.{self.name}")
        if args.cells > min(size):
            raise HookrunError(
                f"derive.{self.name}.cells: {args.cells} is more cells than the image's "
                f"{min(size)} pixels a side; valid: 1..{min(size)}"
            )
        return size

    def extra_rows(self, args: RiseArgs, state: Any, sample: tuple[int, ...]) -> tuple:
        return args.masks, sample  # one masked copy per mask

    def check_sizes(
        self, args: RiseArgs, state: tuple[int, int], rows: int, sample: tuple[int, ...]
    ) -> None:
        # A batch's masks at once, in float32: upsampled, (cells + 1)^2 cells, then cropped
        # to the image; each row's score of each.
        h, w = state
        up = (args.cells + 1) ** 2 * math.ceil(h / args.cells) * math.ceil(w / args.cells)
        need = 4 * args.masks * (up + h * w + rows)
        what = f"a batch's {args.masks} masks of {h} x {w}"
        check_fits(f"derive.{self.name}.masks", args.masks, need, what)

    def stored_shapes(self, args: RiseArgs, state: Any, key: str, sample: tuple) -> dict:
        return {
            key: tuple(state),
            CELLS_KEY: (args.masks, args.cells, args.cells),
            SHIFTS_KEY: (args.masks, 2),
        }

    def passes(self, args: RiseArgs, state: tuple[int, int], batch: BatchContext) -> dict:
        x = batch.inputs
        cells, shifts = draw_masks(args, state, batch.generator(self.name), x.device)
        masks = masks_from(cells, shifts, state)

        def make(ks: range) -> torch.Tensor:
            return (x[None] * masks[ks.start : ks.stop, None, None]).flatten(0, 1)

        def probability(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            # over the output's values flattened, as every target is read (targets.py)
            flat = output.float().reshape(len(output), -1)
            return flat.softmax(-1).gather(1, targets[:, None].to(flat.device))[:, 0]

        per_pass = perturbation_rows(args.internal_batch_size, x)
        scores = perturbed_scores(batch, args.masks, make, per_pass, probability)  # (N, masks)
        saliency = torch.einsum("nm,mhw->nhw", scores, masks) / (args.masks * args.p)
        rows = len(x)
        return {
            layout.derived_key(self.name, "input"): saliency.float().cpu(),
            CELLS_KEY: cells.to(torch.uint8).cpu().expand(rows, *cells.shape).clone(),
            SHIFTS_KEY: shifts.to(torch.int32).cpu().expand(rows, *shifts.shape).clone(),
        }
