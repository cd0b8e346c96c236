"""Grad-CAM's successors at one layer (`derive.<method>.layer`, the presets' model.cam_layer):
- grad_cam_pp: Grad-CAM++ (Chattopadhyay et al. 2018), relu(Σ_k w_k A^k) with the closed-form
  weights w_k = Σ_ij α_ij^k relu(g_ij^k), α = g² / (2 g² + Σ_ab A_ab^k g³ + ε), α = 0 where
  g = 0 — the exponential-output form pytorch-grad-cam computes (its eq. 19).
- layer_cam: LayerCAM (Jiang et al. 2021), relu(Σ_k relu(g^k) ⊙ A^k): each position weighted
  by its own positive gradient, so shallow layers give fine-grained maps.

The math is written on channels-first (N, C, H, W) tensors in the two functions below; the
layer's layout (channels-last, tokens) is converted first, as for Grad-CAM (stages/derive/cam.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hookrun.runtime.spatial import Grid
from hookrun.stages.derive.cam import CamArgs, GradCAM, as_float
from hookrun.stages.derive.registry import register_method

__all__ = ["grad_cam_pp_map", "layer_cam_map", "GradCAMPlusPlus", "LayerCAM"]

# pytorch-grad-cam's ε: keeps α finite where the denominator vanishes.
_EPS = 1e-6


def grad_cam_pp_map(activation: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """Grad-CAM++ of (N, C, H, W) activations and gradients: the (N, H, W) map."""
    a, g = as_float(activation), as_float(gradient)
    g2 = g * g
    sum_a = a.sum(dim=(2, 3), keepdim=True)
    alpha = g2 / (2 * g2 + sum_a * g2 * g + _EPS)
    alpha = torch.where(g != 0, alpha, torch.zeros_like(alpha))
    weights = (torch.relu(g) * alpha).sum(dim=(2, 3), keepdim=True)
    return torch.relu((weights * a).sum(dim=1))


def layer_cam_map(activation: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """LayerCAM of (N, C, H, W) activations and gradients: the (N, H, W) map."""
    return torch.relu((torch.relu(as_float(gradient)) * as_float(activation)).sum(dim=1))


class _CamFromGradients(GradCAM):
    """Reads the layer's output and its gradient, like Grad-CAM (same `requires`)."""

    def _map(self, activation: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute(
        self, args: CamArgs, state: Grid, records: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        return self._map(*self.maps(args, state, records))  # any layout, as (N, C, H, W)


@register_method("grad_cam_pp")
class GradCAMPlusPlus(_CamFromGradients):
    def _map(self, activation: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        return grad_cam_pp_map(activation, gradient)


@register_method("layer_cam")
class LayerCAM(_CamFromGradients):
    def _map(self, activation: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        return layer_cam_map(activation, gradient)
