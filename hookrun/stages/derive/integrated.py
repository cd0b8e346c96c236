"""Integrated gradients (Sundararajan et al. 2017) of the target score w.r.t. the model input:
(x − x') ⊙ ∫₀¹ ∇f(x' + α (x − x')) dα, the integral by `method` in `steps` points — the
quadrature Captum's IntegratedGradients uses (Gauss–Legendre, or a Riemann sum).

`derive.integrated_gradients`: steps (50), baseline x' (zeros | mean: each sample's channel
means | blur: each sample Gaussian-blurred | a number), method (gausslegendre |
riemann_left | riemann_right | riemann_middle | riemann_trapezoid), internal_batch_size
(rows per extra pass; null: as many as 8M input values allow, 682 rows of 3×64×64, 55 of
3×224×224 — steps × batch never has to fit at once).

Results: /derived/integrated_gradients/input (the input's shape) and its completeness gap
Σ attributions − (f(x) − f(x')) per sample (0 for an exact integral; the summary prints the
worst).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.memory import check_fits
from hookrun.stages.derive.bounds import check_rows_per_pass
from hookrun.stages.derive.gradients import input_gradient, rows_per_pass
from hookrun.stages.derive.registry import BatchContext, Method, register_method
from hookrun.typed import Frozen

__all__ = ["IntegratedGradients", "IGArgs", "quadrature", "baseline_of"]

QUADRATURES = (
    "gausslegendre",
    "riemann_left",
    "riemann_right",
    "riemann_middle",
    "riemann_trapezoid",
)
BASELINES = ("zeros", "mean", "blur")
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# blur: a Gaussian of this standard deviation, as a fraction of the image's smaller side.
BLUR_SIGMA = 0.1


@dataclass
class IGArgs(Frozen):
    steps: int = 50
    """Points on the path from the baseline to the input at which the gradient is taken."""
    baseline: str = "zeros"
    """zeros | mean | blur | a number (e.g. 0.5)"""
    method: str = "gausslegendre"
    """The quadrature rule (Captum's): gausslegendre | riemann_left | riemann_right |
    riemann_middle | riemann_trapezoid.
    """
    internal_batch_size: int | None = None
    """Rows per extra forward/backward pass; null: by input size (stages/derive/gradients.py)."""


def _leggauss(steps: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy's `leggauss(steps)`, bit for bit, in O(steps²): numpy hands its tridiagonal
    companion matrix to a dense eigensolver (O(steps³), one LAPACK call of 36 s for 4000
    steps on two busy cores, which no signal can stop), whose reduction to tridiagonal form
    changes nothing here before the same dsterf gives the roots."""
    from numpy.polynomial import legendre
    from scipy.linalg import eigvalsh_tridiagonal  # with a Gauss-Legendre run only

    c = np.array([0] * steps + [1])
    scale = 1.0 / np.sqrt(2 * np.arange(steps) + 1)
    off = np.arange(1, steps) * scale[:-1] * scale[1:]  # legcompanion's off-diagonal
    x = eigvalsh_tridiagonal(np.zeros(steps), off, lapack_driver="sterf")
    # From here as numpy's leggauss: one Newton step, the weights, symmetrised.
    dy = legendre.legval(x, c)
    df = legendre.legval(x, legendre.legder(c))
    x -= dy / df
    fm = legendre.legval(x, c[1:])
    fm /= np.abs(fm).max()
    df /= np.abs(df).max()
    w = 1 / (fm * df)
    w = (w + w[::-1]) / 2
    x = (x - x[::-1]) / 2
    w *= 2.0 / w.sum()
    return x, w


def quadrature(method: str, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The points α in [0, 1] and their weights (float64) of an integral over [0, 1]."""
    if method == "gausslegendre":
        x, w = _leggauss(steps)
        return torch.from_numpy(0.5 * (1 + x)), torch.from_numpy(0.5 * w)
    weights = torch.full((steps,), 1 / steps, dtype=torch.float64)
    n = steps
    if method == "riemann_trapezoid":
        weights[0] /= 2
        weights[-1] /= 2
        alphas = torch.linspace(0, 1, n, dtype=torch.float64)
    else:
        low, high = {
            "riemann_left": (0, 1 - 1 / n),
            "riemann_right": (1 / n, 1),
            "riemann_middle": (1 / (2 * n), 1 - 1 / (2 * n)),
        }[method]
        alphas = torch.linspace(low, high, n, dtype=torch.float64)
    return alphas, weights


def baseline_of(baseline: str, x: torch.Tensor) -> torch.Tensor:
    """The baseline x' for the batch `x` (N, ...), one per sample."""
    if baseline == "zeros":
        return torch.zeros_like(x)
    if baseline == "mean":
        # Each sample's mean per channel (axis 1) over the other axes: a flat grey photo.
        axes = tuple(range(2, x.dim())) if x.dim() > 2 else (1,)
        return x.mean(dim=axes, keepdim=True).expand_as(x).contiguous()
    if baseline == "blur":
        sigma = BLUR_SIGMA * min(x.shape[-2:])
        size = 2 * math.ceil(3 * sigma) + 1
        from torchvision.transforms.functional import gaussian_blur  # with an image run only

        return gaussian_blur(x, [size, size], [sigma, sigma])
    return torch.full_like(x, float(baseline))


def _is_number(text: str, dtype: torch.dtype = torch.float32) -> bool:
    """A finite number that `dtype` holds (torch refuses to fill a float32 tensor with
    1e39; NaN or infinity would make every attribution NaN)."""
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and abs(value) <= torch.finfo(dtype).max


@register_method("integrated_gradients")
class IntegratedGradients(Method):
    Args = IGArgs
    runs_passes = True
    # On token data: the input embeddings (BatchContext.explained), results (N, T, D).
    tokens_ok = explains_input = True
    gap_note = "more steps make it smaller"

    @classmethod
    def check(cls, args: IGArgs, key: str) -> None:
        if args.method not in QUADRATURES:
            raise HookrunError(f"{key}.method: {args.method!r}; valid: {', '.join(QUADRATURES)}")
        low = 2 if args.method.startswith("riemann") else 1
        if args.steps < low:
            raise HookrunError(
                f"{key}.steps: {args.steps} is out of range for {args.method}; valid: >= {low}"
            )
        # Gauss-Legendre's nodes come from numpy's steps x steps eigenproblem (float64);
        # Riemann sums need two vectors of steps.
        need = 8 * args.steps**2 if args.method == "gausslegendre" else 16 * args.steps
        check_fits(f"{key}.steps", args.steps, need, f"the {args.method} quadrature")
        if args.baseline not in BASELINES and not _is_number(args.baseline):
            raise HookrunError(
                f"{key}.baseline: {args.baseline!r}; valid: {', '.join(BASELINES)}, or a "
                f"finite number from {-_FLOAT32_MAX:.4g} to {_FLOAT32_MAX:.4g}"
            )
        check_rows_per_pass(key, args.internal_batch_size)

    def requires(self, args: IGArgs) -> list[str]:
        return []

    def prepare(self, args: IGArgs, model: nn.Module, sample: torch.Tensor) -> None:
        number = args.baseline not in BASELINES and sample.is_floating_point()
        if number and not _is_number(args.baseline, sample.dtype):  # a float16 model's input
            most = float(torch.finfo(sample.dtype).max)
            raise HookrunError(
                f"derive.{self.name}.baseline: {args.baseline!r} is past what the input "
                f"({str(sample.dtype).removeprefix('torch.')}) holds; valid: "
                f"{', '.join(BASELINES)}, or a finite number from {-most:.4g} to {most:.4g}"
            )
        if args.baseline == "blur" and sample.dim() != 3:
            raise HookrunError(
                f"derive.{self.name}.baseline: 'blur' needs images (C, H, W), the model input "
                f"is {list(sample.shape)}; valid here: zeros, mean, or a number"
            )

    def stored_shapes(
        self, args: IGArgs, state: None, key: str, sample: tuple[int, ...]
    ) -> dict[str, tuple[int, ...]]:
        return {key: sample, layout.gap_key(self.name, "input"): ()}

    def extra_rows(self, args: IGArgs, state: None, sample: tuple[int, ...]) -> tuple:
        return args.steps, sample  # one point per step per row

    def passes(self, args: IGArgs, state: None, batch: BatchContext) -> dict[str, torch.Tensor]:
        x = batch.explained().detach()
        base = baseline_of(args.baseline, x)
        diff = x - base
        alphas, weights = (t.to(x.device, x.dtype) for t in quadrature(args.method, args.steps))
        n, ones = len(x), (1,) * (x.dim() - 1)
        total = torch.zeros_like(x)
        rows = rows_per_pass(args.internal_batch_size, x)
        # Rows (step, sample) in step-major order, `rows` of them per pass.
        for start in range(0, args.steps * n, rows):
            index = torch.arange(start, min(start + rows, args.steps * n), device=x.device)
            step, sample = index // n, index % n
            points = base[sample] + alphas[step].view(-1, *ones) * diff[sample]
            grad = input_gradient(batch, points, sample)
            total.index_add_(0, sample, grad * weights[step].view(-1, *ones))
        attribution = diff * total
        with torch.no_grad():
            both = torch.arange(n, device=x.device).repeat(2)  # x's rows, then the baseline's
            f = batch.score(batch.run(torch.cat([x, base]), both), batch.targets[both])
        gap = attribution.flatten(1).sum(1) - (f[:n] - f[n:])
        return {
            layout.derived_key(self.name, "input"): attribution.float().cpu(),
            layout.gap_key(self.name, "input"): gap.float().cpu(),
        }
