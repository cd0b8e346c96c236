"""Perturbation methods: no gradient, only the target score of perturbed copies of each row,
batched (the run's hooks stand aside). This module holds what they share — the batched
scoring of perturbed copies, the rows a pass takes — and occlusion; feature ablation and
KernelSHAP are in segments.py, RISE in rise.py, Score-CAM and Ablation-CAM in cam_scores.py.

- occlusion (Zeiler & Fergus 2014; as Captum's `Occlusion` over every channel): a window of
  `window` pixels slid by `stride` (the last one in each direction cut at the edge); each
  pixel's attribution is the mean, over the windows that cover it, of score(x) − score(x
  with the window set to `baseline`).

Scores are the run's target score (the target logit, or the outputs' sum for target.kind=sum)
except RISE's, the target's softmax probability as in the paper. Rows per pass:
`internal_batch_size`, or as many as 1M input values allow on the CPU (CPU_INPUT_VALUES) and
8M on a GPU (as integrated gradients). A baseline is a finite number the input's dtype holds
(bounds.check_number). Result: the input's shape (every channel the same).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.stages.derive.bounds import check_number, check_rows_per_pass
from hookrun.stages.derive.gradients import rows_per_pass
from hookrun.stages.derive.registry import BatchContext, Method, register_method
from hookrun.typed import Frozen

__all__ = [
    "Occlusion",
    "perturbed_scores",
    "perturbation_rows",
    "plain_score",
    "image_size",
    "check_baseline",
]


def perturbed_scores(
    batch: BatchContext,
    count: int,
    make: Callable[[range], torch.Tensor],
    per_pass: int,
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """(N, count): each row's score of its `count` perturbed copies, without gradients.
    `make(ks)` gives the copies of every row for perturbations `ks`, k-major: (len(ks) · N,
    …), row k · N + n standing for batch row n. `per_pass`: rows a pass may take. `run`:
    what the copies go through (points, sample) → output; the model by default."""
    n = len(batch.targets)
    every = torch.arange(n, device=batch.targets.device)
    score = score or batch.score
    run = run or batch.run
    out = torch.empty((count, n), device=batch.targets.device)
    step = max(1, per_pass // n)
    with torch.no_grad():
        for start in range(0, count, step):
            ks = range(start, min(start + step, count))
            sample = every.repeat(len(ks))
            out[start : start + len(ks)] = (
                score(run(make(ks), sample), batch.targets[sample]).float().view(len(ks), n)
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


def plain_score(batch: BatchContext) -> torch.Tensor:
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


def check_baseline(key: str, value: Any, sample: torch.Tensor | None = None) -> None:
    """`key`: a baseline written into the input — finite, within float32 (config time) and
    within the input's own dtype (`sample`, at plan time: a float16 model's input holds
    less)."""
    check_number(key, value)
    if sample is not None and sample.is_floating_point():
        check_number(key, value, sample.dtype)


def _pair(value: Any, key: str) -> tuple[int, int]:
    values = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(values) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise HookrunError(f"{key}: {value!r}; valid: an integer, or [height, width]")
    if min(values) < 1:
        raise HookrunError(f"{key}: {value!r} is out of range; valid: integers >= 1")
    return values[0], values[1]


@dataclass
class OcclusionArgs(Frozen):
    window: Any = 16
    """pixels, or [height, width]"""
    stride: Any = 8
    """pixels between windows, or [height, width]"""
    baseline: float = 0.0
    """The value an occluded pixel takes."""
    internal_batch_size: int | None = None
    """Occluded images per forward pass; null: by input size."""


@register_method("occlusion")
class Occlusion(Method):
    Args = OcclusionArgs
    runs_passes = True
    perturbs = "occlusion sets windows of an image's pixels to a baseline"

    @classmethod
    def check(cls, args: OcclusionArgs, key: str) -> None:
        window, stride = _pair(args.window, f"{key}.window"), _pair(args.stride, f"{key}.stride")
        if any(s > w for s, w in zip(stride, window, strict=True)):
            raise HookrunError(
                f"{key}.stride: {args.stride!r} is larger than the window {args.window!r} "
                "(pixels between windows would be left out); valid: a stride <= the window"
            )
        check_baseline(f"{key}.baseline", args.baseline)
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
        check_baseline(f"{key}.baseline", args.baseline, sample)
        stride = _pair(args.stride, f"{key}.stride")
        starts = [
            [i * st for i in range(math.ceil((s - w) / st) + 1)]
            for s, w, st in zip(size, window, stride, strict=True)
        ]
        return size, window, starts

    def extra_rows(self, args: OcclusionArgs, state: Any, sample: tuple[int, ...]) -> tuple:
        if state is None:  # config time: the windows need the image's size
            return 1, sample
        _, _, (ys, xs) = state
        return len(ys) * len(xs), sample  # one copy per window

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
        drops = plain_score(batch)[:, None] - perturbed_scores(batch, len(boxes), make, per_pass)
        total = torch.zeros((len(x), h, w), device=x.device)
        covered = torch.zeros((h, w), device=x.device)
        for k, (y0, y1, x0, x1) in enumerate(boxes):
            total[:, y0:y1, x0:x1] += drops[:, k, None, None]
            covered[y0:y1, x0:x1] += 1
        out = (total / covered)[:, None].expand(x.shape)
        return {layout.derived_key(self.name, "input"): out.float().cpu()}
