"""From an attribution to the relevance of each pixel, and the order pixels are perturbed in.

A CAM map (N, h, w) is upsampled bilinearly (align_corners=False) to the input's (H, W); an
input-shaped attribution (N, C, H, W) is reduced over channels by `abs_sum` (Σ|a|), `sum`
(Σa) or `max_abs` (max|a|). Pixels are ordered by descending relevance, ties in row-major
order (a stable sort): `ranks[i, p]` is pixel p's place in sample i's order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hookrun.errors import HookrunError

__all__ = ["REDUCTIONS", "reduce_channels", "pixel_relevance", "pixel_ranks", "check_attribution"]

REDUCTIONS = ("abs_sum", "sum", "max_abs")


def reduce_channels(attribution: torch.Tensor, reduce: str) -> torch.Tensor:
    """(N, C, H, W) → (N, H, W) by `reduce`."""
    if reduce == "abs_sum":
        return attribution.abs().sum(dim=1)
    if reduce == "sum":
        return attribution.sum(dim=1)
    if reduce == "max_abs":
        return attribution.abs().amax(dim=1)
    raise ValueError(f"unknown reduction {reduce!r}")


def check_attribution(key: str, shape: tuple[int, ...], sample: tuple[int, ...]) -> None:
    """Refuse an attribution whose per-sample `shape` is neither a map (h, w) nor the
    input's (C, H, W) = `sample`, or an input that is not an image."""
    if len(sample) != 3:
        raise HookrunError(
            f"{key}: evaluation perturbs the pixels of images (C, H, W), the model input is "
            f"{list(sample)}; valid: image datasets"
        )
    if len(shape) != 2 and tuple(shape) != tuple(sample):
        raise HookrunError(
            f"{key}: has shape {list(shape)} per sample; valid: a map (h, w) or the input's "
            f"shape {list(sample)}"
        )


def pixel_relevance(attribution: torch.Tensor, image: tuple[int, int], reduce: str) -> torch.Tensor:
    """(N, H, W) float32 relevance of each pixel of images of `image` = (H, W) pixels."""
    a = attribution.float()
    if a.dim() == 4:
        return reduce_channels(a, reduce)
    if tuple(a.shape[-2:]) == tuple(image):
        return a
    return F.interpolate(a[:, None], size=image, mode="bilinear", align_corners=False)[:, 0]


def pixel_ranks(relevance: torch.Tensor) -> torch.Tensor:
    """(N, H·W) int64: each pixel's place when pixels are sorted by descending relevance,
    ties in row-major order."""
    flat = relevance.reshape(len(relevance), -1)
    order = torch.sort(flat, dim=1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    places = torch.arange(flat.shape[1]).expand_as(order).contiguous()
    return ranks.scatter_(1, order, places)
