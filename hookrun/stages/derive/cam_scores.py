"""CAM maps weighted by scores of perturbed passes instead of gradients, at one layer
(`derive.<method>.layer`, the presets' model.cam_layer), as pytorch-grad-cam computes them:

- score_cam (Wang et al. 2020): each channel k of the layer's activation A, upsampled to the
  input's size (bilinear, corners aligned) and scaled to [0, 1] (min-max, + 1e-8), masks the
  input; w = softmax over the channels of the masked inputs' target scores.
- ablation_cam (Desai & Ramaswamy 2020): the model run again with channel k of the layer's
  output set to 0; w_k = (y − y_k) / y, y the target score and y_k the ablated run's.

The map is relu(Σ_k w_k A_k) at the layer's grid, (N, H, W), like grad_cam's. One pass per
channel per row, batched (`internal_batch_size`, or perturb.perturbation_rows: 1M input
values a pass on the CPU, 8M on a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookrun.io import layout
from hookrun.runtime.handles import ModuleHook, hooked
from hookrun.runtime.layouts import Grid, Layout, to_channels_first
from hookrun.stages.derive.cam import CamArgs, layer_grid
from hookrun.stages.derive.gradients import check_rows_per_pass
from hookrun.stages.derive.perturb import _plain_score, perturbation_rows, perturbed_scores
from hookrun.stages.derive.registry import BatchContext, Method, register_method

__all__ = ["ScoreCAM", "AblationCAM"]


@dataclass
class ScoreCamArgs(CamArgs):
    internal_batch_size: int | None = None


class _ScoredCAM(Method):
    """A CAM whose weights come from passes of the model (reads_batch: the layer's
    captured activation, and the batch for the passes)."""

    Args = ScoreCamArgs
    reads_batch = True
    needs_class = True  # the passes score the target class

    @classmethod
    def check(cls, args: ScoreCamArgs, key: str) -> None:
        check_rows_per_pass(key, args.internal_batch_size)

    def requires(self, args: ScoreCamArgs) -> list[str]:
        return [layout.capture_key(args.layer, "output")]

    def prepare(self, args: ScoreCamArgs, model: nn.Module, sample: torch.Tensor) -> Grid:
        return layer_grid(args, model, sample, self.name)[0]

    def compute_batch(
        self, args: ScoreCamArgs, state: Any, records: Mapping[str, torch.Tensor], batch: Any
    ) -> dict[str, torch.Tensor]:
        grid = state
        raw = records[layout.capture_key(args.layer, "output")].to(batch.targets.device)
        activation = to_channels_first(raw.float(), grid.layout, grid.prefix_tokens, grid.size)
        weights = self.weights(args, grid, activation, batch)  # (N, C)
        cam = torch.relu(torch.einsum("nc,nchw->nhw", weights, activation))
        return {layout.derived_key(self.name, str(args.layer)): cam.float().cpu()}

    def weights(
        self,
        args: Any,
        state: Any,
        activation: torch.Tensor,
        batch: BatchContext,
    ) -> torch.Tensor:
        raise NotImplementedError

    def stored_shapes(self, args: Any, state: Any, key: str, sample: tuple) -> dict:
        return {key: state.size}


@register_method("score_cam")
class ScoreCAM(_ScoredCAM):
    def weights(self, args, state, activation, batch) -> torch.Tensor:
        x = batch.inputs
        n, c = activation.shape[:2]
        up = F.interpolate(activation, size=x.shape[-2:], mode="bilinear", align_corners=True)
        flat = up.flatten(2)
        low, high = flat.min(-1).values[..., None, None], flat.max(-1).values[..., None, None]
        masks = (up - low) / (high - low + 1e-8)  # (N, C, H, W)

        def make(ks: range) -> torch.Tensor:  # k-major: channel k of every row
            return (x[None] * masks[:, ks.start : ks.stop].transpose(0, 1)[:, :, None]).flatten(
                0, 1
            )

        per_pass = perturbation_rows(args.internal_batch_size, x)
        return perturbed_scores(batch, c, make, per_pass).softmax(-1)


@register_method("ablation_cam")
class AblationCAM(_ScoredCAM):
    def weights(self, args, state, activation, batch) -> torch.Tensor:
        grid, x = state, batch.inputs
        n, c = activation.shape[:2]
        module = dict(batch.model.named_modules())[str(args.layer)]
        # The channel axis of the layer's own output: 1 channels-first, else the last.
        axis = 1 if grid.layout == Layout.nchw else -1
        pending: list[range] = []

        def ablate(m: nn.Module, inputs: tuple, output: Any) -> Any:
            tensor = output[0] if isinstance(output, tuple) else output
            ks = pending[0]
            tensor = tensor.clone().view(len(ks), n, *tensor.shape[1:])
            for i, k in enumerate(ks):
                tensor.select(axis if axis < 0 else axis + 1, k)[i] = 0
            tensor = tensor.flatten(0, 1)
            return (tensor, *output[1:]) if isinstance(output, tuple) else tensor

        def make(ks: range) -> torch.Tensor:
            pending[:] = [ks]
            return x.repeat(len(ks), *(1,) * (x.dim() - 1))

        per_pass = perturbation_rows(args.internal_batch_size, x)
        plain = _plain_score(batch)
        with hooked([ModuleHook(module, ablate)]):
            ablated = perturbed_scores(batch, c, make, per_pass)
        return (plain[:, None] - ablated) / plain[:, None]
