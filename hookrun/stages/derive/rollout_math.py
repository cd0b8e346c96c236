"""Attention rollout's arithmetic (Abnar & Zuidema 2020), on tensors alone: each layer's
attention fused over its heads, the lowest entries optionally discarded, the residual added
as the identity (Â = (A + I) / 2, rows renormalised), and rows of the product
Â_L · … · Â_s taken without forming it.

Head fusion and discarding follow jacobgil/vit-explain's `vit_rollout.py` (mean, max or
min over heads; the lowest `discard_ratio` of a fused matrix's T² entries set to zero), with
two differences: ties are broken by position (a stable sort), and no entry is exempt (its
code keeps entry (0, 0), the class token's own: here the identity keeps every token's own
path, so no row can become zero). Its `a / a.sum(dim=-1)` divides column j by row j's sum
(no keepdim); here each row is divided by its own sum, as the paper means.
"""

from __future__ import annotations

import torch

__all__ = ["HEAD_FUSIONS", "fuse_heads", "discard_lowest", "with_residual", "rollout_rows"]

HEAD_FUSIONS = ("mean", "max", "min")


def fuse_heads(probs: torch.Tensor, head_fusion: str) -> torch.Tensor:
    """(N, heads, T, T) attention probabilities → (N, T, T) by `head_fusion` over the heads."""
    if head_fusion == "mean":
        return probs.mean(dim=1)
    if head_fusion == "max":
        return probs.amax(dim=1)
    if head_fusion == "min":
        return probs.amin(dim=1)
    raise ValueError(f"unknown head fusion {head_fusion!r}")


def discard_lowest(
    fused: torch.Tensor, ratio: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`fused` (N, T, T) with the floor(ratio · t²) smallest entries of each sample's matrix
    set to zero, the earliest (row-major) first among equal values; t is the sample's real
    tokens (`mask` (N, T), True where real; None: all T), and only entries between two real
    tokens are ranked — a row's result does not depend on its batch's padding."""
    n, t, _ = fused.shape
    real = torch.full((n,), t, device=fused.device) if mask is None else mask.sum(1)
    counts = (ratio * real.to(torch.float64) ** 2).floor().long()
    if not counts.any():
        return fused
    flat = fused.reshape(n, t * t)
    ranked = flat
    if mask is not None:  # entries with a padded query or key sort after every real one
        pair = (mask[:, :, None] & mask[:, None, :]).reshape(n, t * t)
        ranked = flat.masked_fill(~pair, float("inf"))
    order = torch.argsort(ranked, dim=1, stable=True)
    places = torch.arange(t * t, device=fused.device).expand(n, -1)
    rank = torch.empty_like(order).scatter_(1, order, places)
    return flat.masked_fill(rank < counts[:, None], 0.0).view(n, t, t)


def with_residual(fused: torch.Tensor) -> torch.Tensor:
    """(A + I) / 2 with each row divided by its sum: the residual connection as half of
    every token's attention to itself (the paper's 0.5·A + 0.5·I; rows of a mean of
    probabilities already sum to 1, those of a max, min or discarded matrix do not)."""
    eye = torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
    mixed = (fused + eye) / 2
    return mixed / mixed.sum(dim=-1, keepdim=True)


def rollout_rows(layers: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """Row `rows[n]` of Â_L · … · Â_1 for each sample n, `layers` = [Â_1, …, Â_L], each
    (N, T, T): the one-hot row times Â_L, then Â_{L-1}, … — T² work a layer instead of the
    product's T³. Returns (N, T) in the layers' dtype."""
    first = layers[0]
    vector = torch.zeros(first.shape[0], 1, first.shape[-1], dtype=first.dtype, device=first.device)
    vector[torch.arange(len(rows), device=first.device), 0, rows.to(first.device)] = 1.0
    for layer in reversed(layers):
        vector = vector @ layer
    return vector[:, 0]
