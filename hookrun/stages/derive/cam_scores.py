"""CAM maps weighted by scores of perturbed passes instead of gradients, at one layer
(`derive.<method>.layer`, the presets' model.cam_layer), as pytorch-grad-cam computes them:

- score_cam (Wang et al. 2020): each channel k of the layer's activation A, upsampled to the
  input's size (bilinear, corners aligned) and scaled to [0, 1] (min-max, + 1e-8), masks the
  input; w = softmax over the channels of the masked inputs' target scores. The masks are
  made for each pass's channels only.
- ablation_cam (Desai & Ramaswamy 2020): the model's output again with channel k of the
  layer's output set to 0; w_k = (y − y_k) / y, y the target score and y_k the ablated one.
  Only what follows the layer runs, from the layer's output the hooked pass captured
  (after_layer.py), where that can be decided; else the whole model runs with the layer's
  output replaced, many channels a pass.

The map is relu(Σ_k w_k A_k) at the layer's grid, (N, H, W), like grad_cam's. One perturbed
row per channel per row, batched (`internal_batch_size`, or perturb.perturbation_rows: 1M
values a pass on the CPU, 8M on a GPU — of the layer's output where only the rest runs, of
the input otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookrun.io import layout
from hookrun.runtime.handles import ModuleHook, hooked
from hookrun.runtime.spatial import Grid, Layout, to_channels_first
from hookrun.stages.derive.after_layer import Rest, rest_after
from hookrun.stages.derive.bounds import check_rows_per_pass
from hookrun.stages.derive.cam import CamArgs, LayerSample, as_float, layer_grid
from hookrun.stages.derive.perturb import perturbation_rows, perturbed_scores, plain_score
from hookrun.stages.derive.registry import BatchContext, Method, register_method

__all__ = ["ScoreCAM", "AblationCAM", "ScoredLayer"]

log = logging.getLogger("hookrun")


@dataclass
class ScoreCamArgs(CamArgs):
    internal_batch_size: int | None = None
    """Masked images per forward pass; null: by input size."""


@dataclass(frozen=True)
class ScoredLayer:
    """A scored CAM's layer: its grid, its channels, one row of its output as the model
    gives it, and (Ablation-CAM) what follows it."""

    grid: Grid
    channels: int
    row: tuple[int, ...]
    rest: Rest = Rest(None, "not asked for")


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

    def prepare(self, args: ScoreCamArgs, model: nn.Module, sample: torch.Tensor) -> ScoredLayer:
        seen = layer_grid(args, model, sample, self.name)
        channels, row = int(seen.activation.shape[1]), tuple(seen.raw.shape[1:])
        return ScoredLayer(seen.grid, channels, row, self.rest(args, model, seen))

    def rest(self, args: ScoreCamArgs, model: nn.Module, seen: LayerSample) -> Rest:
        """What follows the layer, for a method that perturbs its output (none here)."""
        return Rest(None, "not asked for")

    def extra_rows(self, args: Any, state: ScoredLayer | None, sample: tuple) -> tuple:
        return (1, sample) if state is None else (state.channels, sample)  # one per channel

    def compute_batch(
        self, args: ScoreCamArgs, state: ScoredLayer, records: Mapping[str, Any], batch: Any
    ) -> dict[str, torch.Tensor]:
        grid = state.grid
        raw = records[layout.capture_key(args.layer, "output")].to(batch.targets.device)
        activation = as_float(to_channels_first(raw, grid.layout, grid.prefix_tokens, grid.size))
        weights = self.weights(args, state, raw, activation, batch)  # (N, C)
        cam = torch.relu(torch.einsum("nc,nchw->nhw", weights.to(activation.dtype), activation))
        return {layout.derived_key(self.name, str(args.layer)): cam.cpu()}

    def weights(
        self,
        args: Any,
        state: ScoredLayer,
        raw: torch.Tensor,
        activation: torch.Tensor,
        batch: BatchContext,
    ) -> torch.Tensor:
        """(N, C): each channel's weight, from the layer's output as the model gives it
        (`raw`) or as (N, C, H, W) (`activation`)."""
        raise NotImplementedError

    def stored_shapes(self, args: Any, state: ScoredLayer, key: str, sample: tuple) -> dict:
        return {key: state.grid.size}


@register_method("score_cam")
class ScoreCAM(_ScoredCAM):
    perturbs = "score_cam multiplies an image's pixels by a layer's upsampled activations"

    def weights(self, args, state, raw, activation, batch) -> torch.Tensor:
        x = batch.inputs
        c = activation.shape[1]

        def make(ks: range) -> torch.Tensor:  # k-major: channel k of every row
            up = F.interpolate(
                activation[:, ks.start : ks.stop],
                size=x.shape[-2:],
                mode="bilinear",
                align_corners=True,
            )
            flat = up.flatten(2)
            low, high = flat.min(-1).values[..., None, None], flat.max(-1).values[..., None, None]
            masks = ((up - low) / (high - low + 1e-8)).to(x.dtype)  # (N, len(ks), H, W)
            return (x[None] * masks.transpose(0, 1)[:, :, None]).flatten(0, 1)

        per_pass = perturbation_rows(args.internal_batch_size, x)
        return perturbed_scores(batch, c, make, per_pass).softmax(-1)


@register_method("ablation_cam")
class AblationCAM(_ScoredCAM):
    perturbs = "ablation_cam zeroes channels of a layer's image grid (H x W) and maps over it"

    def rest(self, args: ScoreCamArgs, model: nn.Module, seen: LayerSample) -> Rest:
        rest = rest_after(model, str(args.layer), seen.raw, seen.logits)
        if rest.module is None:
            log.warning(
                "derive.%s: the whole model runs again for each of %s's %d channels (only "
                "what follows it would run, but %s)",
                self.name,
                args.layer,
                int(seen.activation.shape[1]),
                rest.why,
            )
        return rest

    def extra_rows(self, args: Any, state: ScoredLayer | None, sample: tuple) -> tuple:
        if state is not None and state.rest.module is not None:
            return state.channels, state.row  # rows of the layer's output, not the input
        return super().extra_rows(args, state, sample)

    def weights(self, args, state, raw, activation, batch) -> torch.Tensor:
        # The channel axis of the layer's own output: 1 channels-first, else the last.
        axis = 1 if state.grid.layout == Layout.nchw else -1
        rest = state.rest.module
        if rest is None:
            ablated, plain = self._whole_model(args, state, batch, axis), plain_score(batch)
            return (plain[:, None] - ablated) / plain[:, None]

        def make(ks: range) -> torch.Tensor:  # k-major: channel k zeroed in every row
            copies = raw[None].repeat(len(ks), *(1,) * raw.dim())
            for i, k in enumerate(ks):
                copies[i].select(axis, k).zero_()
            return copies.flatten(0, 1)

        with torch.no_grad():
            plain = batch.score(rest(raw), batch.targets).float()
        per_pass = perturbation_rows(args.internal_batch_size, raw)
        ablated = perturbed_scores(batch, state.channels, make, per_pass, run=lambda p, _: rest(p))
        return (plain[:, None] - ablated) / plain[:, None]

    def _whole_model(
        self, args: ScoreCamArgs, state: ScoredLayer, batch: BatchContext, axis: int
    ) -> torch.Tensor:
        """(N, C) ablated scores from whole passes of the model, the layer's output replaced
        by its copies with one channel zeroed each (`axis`: the output's channel axis)."""
        at = axis + 1 if axis > 0 else axis  # in a pass's (k, N, ...) view of the output
        x, n = batch.inputs, len(batch.inputs)
        module = dict(batch.model.named_modules())[str(args.layer)]
        pending: list[range] = []

        def ablate(m: nn.Module, inputs: tuple, output: Any) -> Any:
            tensor = output[0] if isinstance(output, tuple) else output
            ks = pending[0]
            tensor = tensor.clone().view(len(ks), n, *tensor.shape[1:])
            for i, k in enumerate(ks):
                tensor.select(at, k)[i] = 0
            tensor = tensor.flatten(0, 1)
            return (tensor, *output[1:]) if isinstance(output, tuple) else tensor

        def make(ks: range) -> torch.Tensor:
            pending[:] = [ks]
            return x.repeat(len(ks), *(1,) * (x.dim() - 1))

        per_pass = perturbation_rows(args.internal_batch_size, x)
        with hooked([ModuleHook(module, ablate)]):
            return perturbed_scores(batch, state.channels, make, per_pass)
