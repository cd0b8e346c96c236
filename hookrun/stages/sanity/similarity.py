"""How much a map after randomisation still looks like the original's (Adebayo et al. 2018),
per sample: Spearman rank correlation of the absolute maps (`spearman_abs`) and of the
signed maps (`spearman`), and SSIM of the maps min–max scaled to [0, 1] (`ssim`).

Ranks with ties get their average rank (scipy.stats.rankdata); a constant map has no order,
so its rank correlation with anything is 0 (a Grad-CAM of zeros after randomisation shares
nothing with the original). SSIM is scikit-image's `structural_similarity` with
data_range=1 and a window of 7 pixels, smaller (the largest odd size that fits, down to 1,
then without the sample-covariance correction) on maps smaller than 7 × 7.
"""

from __future__ import annotations

import numpy as np
import torch

from hookrun.stages.evaluate.relevance import reduce_channels

__all__ = ["to_map", "spearman", "ssim", "similarities"]


def to_map(attribution: torch.Tensor, reduce: str) -> torch.Tensor:
    """(N, h, w) maps as compared: input-shaped (N, C, H, W) reduced over channels by
    `reduce`, CAM maps as they are; float32."""
    a = attribution.float()
    return reduce_channels(a, reduce) if a.dim() == 4 else a


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rank correlation of each row of `a` with the same row of `b` (N, P) → (N,);
    0 where either row is constant."""
    from scipy.stats import rankdata  # here: scipy.stats costs every run's start-up ~1 s

    ra = rankdata(a, axis=1) - (a.shape[1] + 1) / 2
    rb = rankdata(b, axis=1) - (b.shape[1] + 1) / 2
    norm = np.sqrt((ra * ra).sum(1) * (rb * rb).sum(1))
    return np.where(norm > 0, (ra * rb).sum(1) / np.where(norm > 0, norm, 1), 0.0)


def _scaled(x: np.ndarray) -> np.ndarray:
    span = x.max() - x.min()
    return (x - x.min()) / span if span > 0 else np.zeros_like(x)


def ssim(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """SSIM of each pair of maps (N, h, w), each min–max scaled to [0, 1] first."""
    from skimage.metrics import structural_similarity  # here: costs start-up otherwise

    side = min(a.shape[1:])
    win = min(7, side if side % 2 else side - 1)
    return np.array(
        [
            structural_similarity(
                _scaled(x), _scaled(y), data_range=1.0, win_size=win, use_sample_covariance=win > 1
            )
            for x, y in zip(a, b, strict=True)
        ]
    )


def similarities(maps: torch.Tensor, original: torch.Tensor) -> dict[str, np.ndarray]:
    """Each similarity of `maps` (N, h, w) with `original` (N, h, w), (N,) float64 each."""
    a = maps.double().numpy().reshape(len(maps), -1)
    b = original.double().numpy().reshape(len(original), -1)
    return {
        "spearman_abs": spearman(np.abs(a), np.abs(b)),
        "spearman": spearman(a, b),
        "ssim": ssim(maps.double().numpy(), original.double().numpy()),
    }
