"""Perturbation methods on the input: no gradient, only the target score of perturbed copies
of each row, batched (the run's hooks stand aside).

- occlusion (Zeiler & Fergus 2014; as Captum's `Occlusion` over every channel): a window of
  `window` pixels slid by `stride` (the last one in each direction cut at the edge); each
  pixel's attribution is the mean, over the windows that cover it, of score(x) − score(x
  with the window set to `baseline`).
- feature_ablation (as Captum's `FeatureAblation` with a feature mask): the image cut into
  segments (`segments: slic` — scikit-image's SLIC on the row's image scaled to [0, 1],
  `n_segments`, `compactness`, labels from 0 —, `grid`: `cells` × `cells` rectangles, or
  `file`: an (H, W) integer .npy); each pixel's attribution is score(x) − score(x with its
  segment set to `baseline`).
- kernel_shap (Lundberg & Lee 2017) over the same segments: coalitions of segments kept (the
  rest at `baseline`), `samples` of them drawn from the batch's generator — or all 2^m − 2
  when that many fit, which gives the exact Shapley values — and the Shapley kernel's
  weighted least squares with Σ φ = score(x) − score(baseline) (the completeness gap, stored
  per row as integrated gradients' is, is that sum's rounding).
- rise (Petsiuk et al. 2018): `masks` random masks, each a `cells` × `cells` grid of cells
  kept with probability `p`, upsampled bilinearly to (cells + 1) × the cell size and cropped
  at a random shift; the map is Σ_i P(target | x ⊙ M_i) M_i / (masks · p). The masks are
  drawn from the batch's generator (BatchContext.generator("rise")): one `torch.rand((masks,
  cells, cells))` < p, then the shifts `torch.randint(cell_h, (masks,))` and
  `torch.randint(cell_w, (masks,))`.

Scores are the run's target score (the target logit, or the outputs' sum for target.kind=sum)
except RISE's, the target's softmax probability as in the paper. Rows per pass:
`internal_batch_size`, or as many as 1M input values allow on the CPU (CPU_INPUT_VALUES) and
8M on a GPU (as integrated gradients).
Results: occlusion and feature_ablation the input's shape (every channel the same);
rise (H, W).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.stages.derive.gradients import check_rows_per_pass, rows_per_pass
from hookrun.stages.derive.registry import BatchContext, Method, register_method
from hookrun.typed import Frozen

__all__ = ["Occlusion", "FeatureAblation", "KernelShap", "Rise", "perturbed_scores", "image_size"]


def perturbed_scores(
    batch: BatchContext,
    count: int,
    make: Callable[[range], torch.Tensor],
    per_pass: int,
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """(N, count): each row's score of its `count` perturbed copies, without gradients.
    `make(ks)` gives the copies of every row for perturbations `ks`, k-major: (len(ks) · N,
    …), row k · N + n standing for batch row n. `per_pass`: rows a pass may take."""
    n = len(batch.targets)
    every = torch.arange(n, device=batch.targets.device)
    score = score or batch.score
    out = torch.empty((count, n), device=batch.targets.device)
    step = max(1, per_pass // n)
    with torch.no_grad():
        for start in range(0, count, step):
            ks = range(start, min(start + step, count))
            sample = every.repeat(len(ks))
            out[start : start + len(ks)] = (
                score(batch.run(make(ks), sample), batch.targets[sample]).float().view(len(ks), n)
            )
    return out.T


# internal_batch_size=null on the CPU: rows per pass up to this many input values (6 rows at
# 224 px, 85 at 64 px). Larger passes ran slower there, their activations leaving the caches:
# MobileNetV2 at 224 px did 110-200 images/s in passes of 4 and 38 in passes of 55 on 2
# cores. On a GPU the integrated-gradients budget (8M values) stands.
CPU_INPUT_VALUES = 1 << 20


def perturbation_rows(internal_batch_size: int | None, x: torch.Tensor) -> int:
    """Rows one perturbed pass takes: `internal_batch_size`, else by the input's size and
    device (CPU_INPUT_VALUES on the CPU, gradients.rows_per_pass's budget elsewhere)."""
    if internal_batch_size or x.device.type != "cpu":
        return rows_per_pass(internal_batch_size, x)
    return max(1, CPU_INPUT_VALUES // max(1, x[0].numel()))


def _plain_score(batch: BatchContext) -> torch.Tensor:
    """(N,): each row's score of the unperturbed input."""
    every = torch.arange(len(batch.targets), device=batch.targets.device)
    with torch.no_grad():
        return batch.score(batch.run(batch.inputs, every), batch.targets).float()


def image_size(sample: tuple[int, ...], key: str) -> tuple[int, int]:
    """(H, W) of a (C, H, W) image sample; refused for other inputs."""
    if len(sample) != 3:
        raise HookrunError(
            f"{key}: the model's input is {list(sample)} per sample; valid: images (C, H, W)"
        )
    return int(sample[1]), int(sample[2])


def _pair(value: Any, key: str) -> tuple[int, int]:
    values = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(values) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise HookrunError(f"{key}: {value!r}; valid: an integer, or [height, width]")
    if min(values) < 1:
        raise HookrunError(f"{key}: {value!r} is out of range; valid: integers >= 1")
    return values[0], values[1]


@dataclass
class OcclusionArgs(Frozen):
    window: Any = 16  # pixels, or [height, width]
    stride: Any = 8
    baseline: float = 0.0
    internal_batch_size: int | None = None


@register_method("occlusion")
class Occlusion(Method):
    Args = OcclusionArgs
    runs_passes = True

    @classmethod
    def check(cls, args: OcclusionArgs, key: str) -> None:
        window, stride = _pair(args.window, f"{key}.window"), _pair(args.stride, f"{key}.stride")
        if any(s > w for s, w in zip(stride, window, strict=True)):
            raise HookrunError(
                f"{key}.stride: {args.stride!r} is larger than the window {args.window!r} "
                "(pixels between windows would be left out); valid: a stride <= the window"
            )
        check_rows_per_pass(key, args.internal_batch_size)

    def requires(self, args: OcclusionArgs) -> list[str]:
        return []

    def prepare(self, args: OcclusionArgs, model: Any, sample: torch.Tensor) -> tuple:
        key = f"derive.{self.name}"
        size = image_size(tuple(sample.shape), key)
        window = _pair(args.window, f"{key}.window")
        if any(w > s for w, s in zip(window, size, strict=True)):
            raise HookrunError(
                f"{key}.window: {args.window!r} is larger than the image {list(size)}; valid: "
                f"a window of at most {size[0]} x {size[1]} pixels"
            )
        stride = _pair(args.stride, f"{key}.stride")
        starts = [
            [i * st for i in range(math.ceil((s - w) / st) + 1)]
            for s, w, st in zip(size, window, stride, strict=True)
        ]
        return size, window, starts

    def passes(self, args: OcclusionArgs, state: tuple, batch: BatchContext) -> dict:
        (h, w), (wh, ww), (ys, xs) = state
        x = batch.inputs
        boxes = [(y, min(y + wh, h), xx, min(xx + ww, w)) for y in ys for xx in xs]

        def make(ks: range) -> torch.Tensor:
            copies = x.repeat(len(ks), *(1,) * (x.dim() - 1)).view(len(ks), *x.shape)
            for i, k in enumerate(ks):
                y0, y1, x0, x1 = boxes[k]
                copies[i, :, :, y0:y1, x0:x1] = args.baseline
            return copies.flatten(0, 1)

        per_pass = perturbation_rows(args.internal_batch_size, x)
        drops = _plain_score(batch)[:, None] - perturbed_scores(batch, len(boxes), make, per_pass)
        total = torch.zeros((len(x), h, w), device=x.device)
        covered = torch.zeros((h, w), device=x.device)
        for k, (y0, y1, x0, x1) in enumerate(boxes):
            total[:, y0:y1, x0:x1] += drops[:, k, None, None]
            covered[y0:y1, x0:x1] += 1
        out = (total / covered)[:, None].expand(x.shape)
        return {layout.derived_key(self.name, "input"): out.float().cpu()}


SEGMENTS = ("slic", "grid", "file")


@dataclass
class FeatureAblationArgs(Frozen):
    segments: str = "slic"  # slic | grid | file
    n_segments: int = 50  # slic: about how many
    compactness: float = 10.0  # slic
    cells: int = 8  # grid: cells × cells rectangles
    mask: str | None = None  # file: an (H, W) integer .npy
    baseline: float = 0.0
    internal_batch_size: int | None = None


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


@register_method("feature_ablation")
class FeatureAblation(Method):
    Args = FeatureAblationArgs
    runs_passes = True

    @classmethod
    def check(cls, args: FeatureAblationArgs, key: str) -> None:
        if args.segments not in SEGMENTS:
            raise HookrunError(f"{key}.segments: {args.segments!r}; valid: {', '.join(SEGMENTS)}")
        if args.n_segments < 1 or args.cells < 1:
            bad = "n_segments" if args.n_segments < 1 else "cells"
            raise HookrunError(f"{key}.{bad}: {getattr(args, bad)} is out of range; valid: >= 1")
        if not args.compactness > 0:
            raise HookrunError(f"{key}.compactness: {args.compactness}; valid: > 0")
        if args.segments == "file" and not args.mask:
            raise HookrunError(f"{key}.mask: null with segments: file; valid: an (H, W) .npy")
        check_rows_per_pass(key, args.internal_batch_size)

    def requires(self, args: FeatureAblationArgs) -> list[str]:
        return []

    def prepare(self, args: FeatureAblationArgs, model: Any, sample: torch.Tensor) -> Any:
        key = f"derive.{self.name}"
        h, w = image_size(tuple(sample.shape), key)
        count = {"slic": args.n_segments, "grid": args.cells * args.cells}.get(args.segments, 0)
        if count > h * w:
            what = "n_segments" if args.segments == "slic" else "cells"
            raise HookrunError(
                f"{key}.{what}: {getattr(args, what)} makes {count} segments, more than the "
                f"image's {h * w} pixels; valid: at most {h * w} segments"
            )
        if args.segments != "file":
            return None
        path = Path(str(args.mask)).expanduser()
        try:
            mask = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise HookrunError(f"{key}.mask: {path}: cannot read ({err}); valid: a .npy") from None
        if mask.shape != (h, w) or not np.issubdtype(mask.dtype, np.integer) or mask.min() < 0:
            raise HookrunError(
                f"{key}.mask: {path} holds {mask.dtype} {list(mask.shape)}; valid: integers >= 0 "
                f"of the image's shape [{h}, {w}]"
            )
        return mask.astype(np.int64)

    def passes(self, args: FeatureAblationArgs, state: Any, batch: BatchContext) -> dict:
        x = batch.inputs
        labels = torch.from_numpy(segment_rows(args, x, state)).to(x.device)  # (N, H, W)
        count = int(labels.max()) + 1

        def make(ks: range) -> torch.Tensor:
            copies = x.repeat(len(ks), *(1,) * (x.dim() - 1)).view(len(ks), *x.shape)
            for i, k in enumerate(ks):
                off = (labels == k)[:, None].expand_as(x)
                copies[i][off] = args.baseline
            return copies.flatten(0, 1)

        per_pass = perturbation_rows(args.internal_batch_size, x)
        drops = _plain_score(batch)[:, None] - perturbed_scores(batch, count, make, per_pass)
        out = drops.gather(1, labels.flatten(1)).view(labels.shape)  # each pixel its segment's
        return {layout.derived_key(self.name, "input"): out[:, None].expand(x.shape).float().cpu()}


@dataclass
class RiseArgs(Frozen):
    masks: int = 2000
    cells: int = 7
    p: float = 0.5
    internal_batch_size: int | None = None


def rise_masks(
    args: RiseArgs, size: tuple[int, int], gen: torch.Generator, device: Any
) -> torch.Tensor:
    """(masks, H, W) float: the module docstring's recipe, drawn from `gen`."""
    h, w = size
    cell_h, cell_w = math.ceil(h / args.cells), math.ceil(w / args.cells)
    grid = torch.rand((args.masks, args.cells, args.cells), generator=gen, device=device) < args.p
    dy = torch.randint(cell_h, (args.masks,), generator=gen, device=device)
    dx = torch.randint(cell_w, (args.masks,), generator=gen, device=device)
    up = F.interpolate(
        grid.float()[:, None],
        size=((args.cells + 1) * cell_h, (args.cells + 1) * cell_w),
        mode="bilinear",
        align_corners=False,
    )[:, 0]
    rows = dy[:, None] + torch.arange(h, device=device)[None]  # (masks, H)
    cols = dx[:, None] + torch.arange(w, device=device)[None]  # (masks, W)
    every = torch.arange(args.masks, device=device)[:, None, None]
    return up[every, rows[:, :, None], cols[:, None, :]]


@register_method("rise")
class Rise(Method):
    Args = RiseArgs
    runs_passes = True
    needs_class = True

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

    def passes(self, args: RiseArgs, state: tuple[int, int], batch: BatchContext) -> dict:
        x = batch.inputs
        masks = rise_masks(args, state, batch.generator(self.name), x.device)

        def make(ks: range) -> torch.Tensor:
            return (x[None] * masks[ks.start : ks.stop, None, None]).flatten(0, 1)

        def probability(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return output.float().softmax(-1).gather(1, targets[:, None])[:, 0]

        per_pass = perturbation_rows(args.internal_batch_size, x)
        scores = perturbed_scores(batch, args.masks, make, per_pass, probability)  # (N, masks)
        saliency = torch.einsum("nm,mhw->nhw", scores, masks) / (args.masks * args.p)
        return {layout.derived_key(self.name, "input"): saliency.float().cpu()}

    def stored_shapes(self, args: RiseArgs, state: Any, key: str, sample: tuple) -> dict:
        return {key: tuple(state)}


@dataclass
class KernelShapArgs(FeatureAblationArgs):
    samples: int = 256  # coalitions per row; all of them when 2^segments − 2 is no more


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

    @classmethod
    def check(cls, args: KernelShapArgs, key: str) -> None:
        super().check(args, key)
        if args.samples < 1:
            raise HookrunError(f"{key}.samples: {args.samples} is out of range; valid: >= 1")

    def passes(self, args: KernelShapArgs, state: Any, batch: BatchContext) -> dict:
        x = batch.inputs
        labels = torch.from_numpy(segment_rows(args, x, state)).to(x.device)  # (N, H, W)
        gen = batch.generator(self.name)
        drawn = [_coalitions(int(row.max()) + 1, args.samples, gen) for row in labels.cpu()]
        count = max(len(z) for z, _ in drawn)
        keeps = torch.zeros((len(x), max(count, 1), x.shape[-2], x.shape[-1]), dtype=torch.bool)
        for n, (z, _) in enumerate(drawn):  # each coalition's kept pixels
            keeps[n, : len(z)] = z[:, labels[n].cpu()]
        keeps = keeps.to(x.device)

        def make(ks: range) -> torch.Tensor:
            kept = keeps[:, ks.start : ks.stop].transpose(0, 1)[:, :, None]  # (k, N, 1, H, W)
            return torch.where(kept, x[None], torch.full_like(x[None], args.baseline)).flatten(0, 1)

        per_pass = perturbation_rows(args.internal_batch_size, x)
        scores = perturbed_scores(batch, count, make, per_pass) if count else None
        full = _plain_score(batch)
        empty = perturbed_scores(batch, 1, lambda ks: torch.full_like(x, args.baseline), per_pass)[
            :, 0
        ]
        out = torch.zeros((len(x), x.shape[-2], x.shape[-1]), dtype=torch.float64)
        gaps = torch.zeros(len(x), dtype=torch.float64)
        for n, (z, weight) in enumerate(drawn):
            ends = (float(full[n]), float(empty[n]))
            got = scores[n, : len(z)].cpu() if scores is not None else torch.zeros(0)
            phi = shapley_fit(z, weight, got, ends)
            out[n] = phi[labels[n].cpu()]
            gaps[n] = phi.sum() - (ends[0] - ends[1])
        key = layout.derived_key(self.name, "input")
        return {
            key: out[:, None].expand(x.shape).float(),
            layout.gap_key(self.name, "input"): gaps.float(),
        }

    def stored_shapes(self, args: Any, state: Any, key: str, sample: tuple) -> dict:
        return {key: sample, layout.gap_key(self.name, "input"): ()}
