"""Perturbation methods over an image's segments (no gradient; perturb.py's batched scoring):

- feature_ablation (as Captum's `FeatureAblation` with a feature mask): the image cut into
  segments (`segments: slic` — scikit-image's SLIC on the row's image scaled to [0, 1],
  `n_segments`, `compactness`, labels from 0 —, `grid`: `cells` × `cells` rectangles, or
  `file`: an (H, W) integer .npy, its labels numbered from 0 in increasing order, so only
  the labels it holds are segments); each pixel's attribution is score(x) − score(x with
  its segment set to `baseline`).
- kernel_shap (Lundberg & Lee 2017) over the same segments: coalitions of segments kept (the
  rest at `baseline`), `samples` of them drawn from the batch's generator — or all 2^m − 2
  when that many fit, which gives the exact Shapley values — and the Shapley kernel's
  weighted least squares with Σ φ = score(x) − score(baseline) (the completeness gap, stored
  per row as integrated gradients' is, is that sum's rounding: the fit's constraint holds
  it, whatever `samples`).

Results: the input's shape (every channel the same), and the segments each row was cut into
at /derived/<method>/input.segments (N, H, W) int32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.memory import check_fits
from hookrun.stages.derive.bounds import check_rows_per_pass
from hookrun.stages.derive.perturb import (
    check_baseline,
    image_size,
    perturbation_rows,
    perturbed_scores,
    plain_score,
)
from hookrun.stages.derive.registry import BatchContext, Method, register_method
from hookrun.typed import Frozen

__all__ = [
    "FeatureAblation",
    "FeatureAblationArgs",
    "KernelShap",
    "KernelShapArgs",
    "SEGMENTS_SUFFIX",
    "segments_key",
    "segment_rows",
    "shapley_fit",
]

SEGMENTS = ("slic", "grid", "file")
SEGMENTS_SUFFIX = ".segments"


def segments_key(method: str) -> str:
    """Where a method stores the segments of each row: beside its result."""
    return layout.derived_key(method, "input") + SEGMENTS_SUFFIX


@dataclass
class FeatureAblationArgs(Frozen):
    segments: str = "slic"
    """slic | grid | file"""
    n_segments: int = 50
    """slic: about how many"""
    compactness: float = 10.0
    """slic"""
    cells: int = 8
    """grid: cells × cells rectangles"""
    mask: str | None = None
    """file: an (H, W) integer .npy"""
    baseline: float = 0.0
    """The value the pixels of an ablated segment take."""
    internal_batch_size: int | None = None
    """Perturbed images per forward pass; null: by input size."""


@dataclass(frozen=True)
class SegmentPlan:
    """What the segments are planned on: a mask file's labels numbered from 0 (None for
    slic and grid), and how many segments sample 0 has — a batch has at least as many
    perturbations, which is what its sizes are checked with."""

    mask: np.ndarray | None
    first: int


def segment_rows(args: FeatureAblationArgs, x: torch.Tensor, mask: np.ndarray | None) -> np.ndarray:
    """(N, H, W) int64 segment labels from 0 for each row of images `x` (N, C, H, W)."""
    n, _, h, w = x.shape
    if args.segments == "file":
        assert mask is not None
        return np.broadcast_to(mask, (n, h, w)).copy()
    if args.segments == "grid":
        rows = np.minimum(np.arange(h) * args.cells // h, args.cells - 1)
        cols = np.minimum(np.arange(w) * args.cells // w, args.cells - 1)
        return np.broadcast_to(rows[:, None] * args.cells + cols[None, :], (n, h, w)).copy()
    from skimage.segmentation import slic

    out = np.empty((n, h, w), np.int64)
    for i, image in enumerate(x.detach().float().cpu().numpy()):
        hwc = np.moveaxis(image, 0, -1)
        low, high = hwc.min(), hwc.max()
        scaled = (hwc - low) / (high - low) if high > low else np.zeros_like(hwc)
        grey = hwc.shape[-1] == 1  # one channel: a 2-D image (else SLIC sees a volume)
        out[i] = slic(
            (scaled[..., 0] if grey else scaled).astype(np.float64),
            n_segments=args.n_segments,
            compactness=args.compactness,
            start_label=0,
            channel_axis=None if grey else -1,
        )
    return out


def _read_mask(path_text: str, key: str, size: tuple[int, int]) -> np.ndarray:
    """The mask file's (H, W) labels, numbered from 0 in increasing order: its label values
    size nothing (1e12 and 3 are two segments, as 0 and 1)."""
    path = Path(path_text).expanduser()
    try:
        mask = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise HookrunError(f"{key}: {path}: cannot read ({err}); valid: a .npy") from None
    if mask.shape != size or not np.issubdtype(mask.dtype, np.integer):
        raise HookrunError(
            f"{key}: {path} holds {mask.dtype} {list(mask.shape)}; valid: integers of the "
            f"image's shape [{size[0]}, {size[1]}]"
        )
    return np.unique(mask, return_inverse=True)[1].reshape(size).astype(np.int64)


@register_method("feature_ablation")
class FeatureAblation(Method):
    Args = FeatureAblationArgs
    runs_passes = True
    perturbs = "feature_ablation sets segments of an image's pixels to a baseline"

    @classmethod
    def check(cls, args: FeatureAblationArgs, key: str) -> None:
        if args.segments not in SEGMENTS:
            raise HookrunError(f"{key}.segments: {args.segments!r}; valid: {', '.join(SEGMENTS)}")
        if args.n_segments < 1 or args.cells < 1:
            bad = "n_segments" if args.n_segments < 1 else "cells"
            raise HookrunError(f"{key}.{bad}: {getattr(args, bad)} is out of range; valid: >= 1")
        if not (args.compactness > 0 and math.isfinite(args.compactness)):
            raise HookrunError(f"{key}.compactness: {args.compactness}; valid: a finite number > 0")
        if args.segments == "file" and not args.mask:
            raise HookrunError(f"{key}.mask: null with segments: file; valid: an (H, W) .npy")
        check_baseline(f"{key}.baseline", args.baseline)
        check_rows_per_pass(key, args.internal_batch_size)

    def requires(self, args: FeatureAblationArgs) -> list[str]:
        return []

    def prepare(self, args: FeatureAblationArgs, model: Any, sample: torch.Tensor) -> SegmentPlan:
        key = f"derive.{self.name}"
        h, w = image_size(tuple(sample.shape), key)
        count = {"slic": args.n_segments, "grid": args.cells * args.cells}.get(args.segments, 0)
        if count > h * w:
            what = "n_segments" if args.segments == "slic" else "cells"
            raise HookrunError(
                f"{key}.{what}: {getattr(args, what)} makes {count} segments, more than the "
                f"image's {h * w} pixels; valid: at most {h * w} segments"
            )
        check_baseline(f"{key}.baseline", args.baseline, sample)
        file = args.segments == "file"
        mask = _read_mask(str(args.mask), f"{key}.mask", (h, w)) if file else None
        first = int(segment_rows(args, sample[None], mask).max()) + 1
        return SegmentPlan(mask, first)

    def extra_rows(
        self, args: FeatureAblationArgs, state: SegmentPlan | None, sample: tuple[int, ...]
    ) -> tuple:
        if state is None:  # config time: only a grid's segments are known
            return (args.cells**2 if args.segments == "grid" else 1), sample
        return state.first, sample  # one copy per segment

    def stored_shapes(self, args: Any, state: Any, key: str, sample: tuple) -> dict:
        return {key: sample, segments_key(self.name): tuple(sample[-2:])}

    def passes(self, args: FeatureAblationArgs, state: SegmentPlan, batch: BatchContext) -> dict:
        x = batch.inputs
        rows = segment_rows(args, x, state.mask)
        labels = torch.from_numpy(rows).to(x.device)  # (N, H, W)
        count = int(labels.max()) + 1

        def make(ks: range) -> torch.Tensor:
            copies = x.repeat(len(ks), *(1,) * (x.dim() - 1)).view(len(ks), *x.shape)
            for i, k in enumerate(ks):
                off = (labels == k)[:, None].expand_as(x)
                copies[i][off] = args.baseline
            return copies.flatten(0, 1)

        per_pass = perturbation_rows(args.internal_batch_size, x)
        drops = plain_score(batch)[:, None] - perturbed_scores(batch, count, make, per_pass)
        out = drops.gather(1, labels.flatten(1)).view(labels.shape)  # each pixel its segment's
        return {
            layout.derived_key(self.name, "input"): out[:, None].expand(x.shape).float().cpu(),
            segments_key(self.name): torch.from_numpy(rows.astype(np.int32)),
        }


@dataclass
class KernelShapArgs(FeatureAblationArgs):
    samples: int = 256
    """coalitions per row; all of them when 2^segments − 2 is no more"""


def _coalition_count(m: int, samples: int) -> int:
    """How many coalitions a row of `m` segments is scored on: every proper one when they
    fit in `samples`, else `samples`."""
    return 0 if m < 2 else min(samples, 2**m - 2)


def _coalitions(m: int, samples: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, m) bool coalitions (segments kept) and their weights: every one of the 2^m − 2
    proper coalitions with the Shapley kernel's weight (m − 1) / (C(m, k) k (m − k)) when
    that many fit in `samples` (the exact Shapley values then), else `samples` drawn — a
    size k with probability ∝ (m − 1) / (k (m − k)), then k segments uniformly — each of
    weight 1 (the kernel is in the draw)."""
    if m < 2:
        return torch.zeros((0, m), dtype=torch.bool), torch.zeros(0)
    if 2**m - 2 <= samples:
        codes = torch.arange(1, 2**m - 1)
        z = (codes[:, None] >> torch.arange(m)[None]) & 1 == 1
        k = z.sum(1)
        weight = (m - 1) / (torch.tensor([math.comb(m, int(i)) for i in k]) * k * (m - k))
        return z, weight.double()
    at = gen.device  # the run's device: its generator draws there
    sizes = torch.arange(1, m, device=at)
    p = (m - 1) / (sizes * (m - sizes)).double()
    drawn = sizes[torch.multinomial(p / p.sum(), samples, replacement=True, generator=gen)]
    order = torch.rand((samples, m), generator=gen, device=at).argsort(1)
    z = (order < drawn[:, None]).cpu()  # the first k of a random order
    return z, torch.ones(samples, dtype=torch.float64)


def shapley_fit(
    z: torch.Tensor, weight: torch.Tensor, scores: torch.Tensor, ends: tuple
) -> torch.Tensor:
    """(m,) φ minimising Σ_s w_s (f(z_s) − f(∅) − z_s · φ)² subject to Σ φ = f(x) − f(∅)
    (Lundberg & Lee 2017: the last φ eliminated)."""
    full, empty = ends
    m = z.shape[1]
    total = full - empty
    if m == 1:
        return torch.tensor([total], dtype=torch.float64)
    zf = z.double()
    y = scores.double() - empty - zf[:, -1] * total
    a = zf[:, :-1] - zf[:, -1:]
    sw = weight.sqrt()[:, None]
    head = torch.linalg.lstsq(a * sw, y[:, None] * sw, driver="gelsd").solution[:, 0]
    return torch.cat([head, (total - head.sum())[None]])


@register_method("kernel_shap")
class KernelShap(FeatureAblation):
    Args = KernelShapArgs
    perturbs = "kernel_shap keeps coalitions of an image's pixel segments, the rest at a baseline"
    # The fit eliminates one φ to hold Σ φ = f(x) − f(baseline): more samples change the
    # values, not this gap, which is the float64 fit's rounding stored in float32.
    gap_note = "the fit holds it at 0 but for rounding, whatever samples"

    @classmethod
    def check(cls, args: KernelShapArgs, key: str) -> None:
        super().check(args, key)
        if args.samples < 1:
            raise HookrunError(f"{key}.samples: {args.samples} is out of range; valid: >= 1")

    def extra_rows(
        self, args: KernelShapArgs, state: SegmentPlan | None, sample: tuple[int, ...]
    ) -> tuple:
        segments = super().extra_rows(args, state, sample)[0]
        return max(1, _coalition_count(segments, args.samples)), sample

    def check_sizes(
        self, args: KernelShapArgs, state: SegmentPlan, rows: int, sample: tuple[int, ...]
    ) -> None:
        # Sample 0's coalitions alone: a bool and an int64 (the codes, or the draw's order)
        # per segment, and each row's score of each in float32.
        m = state.first
        count = _coalition_count(m, args.samples)
        what = f"{count} coalitions of sample 0's {m} segments"
        check_fits(f"derive.{self.name}.samples", args.samples, count * (9 * m + 4 * rows), what)

    def stored_shapes(self, args: Any, state: Any, key: str, sample: tuple) -> dict:
        gap = layout.gap_key(self.name, "input")
        return {**super().stored_shapes(args, state, key, sample), gap: ()}

    def passes(self, args: KernelShapArgs, state: SegmentPlan, batch: BatchContext) -> dict:
        x = batch.inputs
        rows = segment_rows(args, x, state.mask)
        labels = torch.from_numpy(rows).to(x.device)  # (N, H, W)
        gen = batch.generator(self.name)
        drawn = [_coalitions(int(row.max()) + 1, args.samples, gen) for row in labels.cpu()]
        count = max(len(z) for z, _ in drawn)
        coalitions = [z.to(x.device) for z, _ in drawn]
        baseline = torch.full_like(x[None], args.baseline)

        def make(ks: range) -> torch.Tensor:
            # Each coalition's kept pixels, made for this pass only; a row with fewer
            # coalitions than the batch's most is scored unperturbed there (never read).
            kept = torch.ones((len(ks), *labels.shape), dtype=torch.bool, device=x.device)
            for n, z in enumerate(coalitions):
                part = z[ks.start : ks.stop]
                kept[: len(part), n] = part[:, labels[n]]
            return torch.where(kept[:, :, None], x[None], baseline).flatten(0, 1)

        per_pass = perturbation_rows(args.internal_batch_size, x)
        scores = perturbed_scores(batch, count, make, per_pass) if count else None
        full = plain_score(batch)
        empty = perturbed_scores(batch, 1, lambda ks: baseline[0], per_pass)[:, 0]
        out = torch.zeros((len(x), x.shape[-2], x.shape[-1]), dtype=torch.float64)
        gaps = torch.zeros(len(x), dtype=torch.float64)
        for n, (z, weight) in enumerate(drawn):
            ends = (float(full[n]), float(empty[n]))
            got = scores[n, : len(z)].cpu() if scores is not None else torch.zeros(0)
            phi = shapley_fit(z, weight, got, ends)
            out[n] = phi[labels[n].cpu()]
            gaps[n] = phi.sum() - (ends[0] - ends[1])
        return {
            layout.derived_key(self.name, "input"): out[:, None].expand(x.shape).float(),
            layout.gap_key(self.name, "input"): gaps.float(),
            segments_key(self.name): torch.from_numpy(rows.astype(np.int32)),
        }
