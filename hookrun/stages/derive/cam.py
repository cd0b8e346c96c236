"""CAM-family methods at one layer (`derive.<method>.layer`, the presets' model.cam_layer):
- grad_cam: relu(Σ_k α_k A^k), α_k = spatial mean of ∂y_c/∂A^k (Selvaraju et al. 2017).
- cam: Σ_k w_ck A^k with w_c the target class's row of the final linear layer (Zhou et al.
  2016); only for models that end in global average pooling + one linear layer.
- guided_grad_cam: the input's Guided Backprop gradient times Grad-CAM upsampled to the
  input's size (bilinear), as in the Grad-CAM paper.
Each works on any layout of the layer's output (channels-first, channels-last, tokens): the
layout is decided once before the first batch (runtime/spatial.py, `derive.<method>.layout`
and `.prefix_tokens` to override), kept as the derivation's state, and the captures are
converted to (N, C, H, W) just before the math; results are (N, H, W).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.models.adapter import adapt
from hookrun.runtime.handles import hooked, output_hooks
from hookrun.runtime.spatial import (
    Grid,
    Layout,
    channels_first_hint,
    decide_grid,
    to_channels_first,
)
from hookrun.stages.derive.registry import LayerArgs, Method, register_method

__all__ = [
    "CamArgs",
    "GradCAM",
    "CAM",
    "GuidedGradCAM",
    "linear_head",
    "layer_grid",
    "LayerSample",
    "as_float",
    "probe_layer",
]


@dataclass
class CamArgs(LayerArgs):
    layout: Layout = Layout.auto
    """auto: found from the layer's output shape; nchw | nhwc | tokens when auto cannot tell."""
    prefix_tokens: int | None = None
    """Tokens before the H*W grid tokens (class, register); null: what the model declares."""


def probe_layer(model: nn.Module, layer: str, sample: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """`layer`'s output and the model's output for one sample."""
    seen: dict[str, Any] = {}

    def keep(module: nn.Module, inputs: tuple, output: Any) -> None:
        seen.setdefault("a", output)  # the first call's output

    with hooked(output_hooks(model, [layer], lambda name: keep)), torch.no_grad():
        logits = model(sample.unsqueeze(0))
    return seen.get("a"), logits


class LayerSample(NamedTuple):
    """The CAM layer on one sample: its grid (the layout decided there), its output as
    (1, C, H, W), the model's output, and the layer's output as the model gives it."""

    grid: Grid
    activation: torch.Tensor
    logits: torch.Tensor
    raw: torch.Tensor


def layer_grid(args: CamArgs, model: nn.Module, sample: torch.Tensor, method: str) -> LayerSample:
    """The layer on one sample (LayerSample); HookrunError naming `derive.<method>` where
    its output is no grid."""
    activation, logits = probe_layer(model, str(args.layer), sample)
    key = f"derive.{method}"
    if not isinstance(activation, torch.Tensor) or activation.dim() < 2:
        raise HookrunError(
            f"{key}.layer: {args.layer!r} gives no tensor output with a batch axis; valid: a "
            "module whose output is (N, C, H, W), (N, H, W, C) or (N, L, D)"
        )
    if args.prefix_tokens is not None and args.prefix_tokens < 0:
        raise HookrunError(f"{key}.prefix_tokens: {args.prefix_tokens} is negative; valid: >= 0")
    prefix = args.prefix_tokens if args.prefix_tokens is not None else adapt(model).prefix_tokens()
    image = (int(sample.shape[-2]), int(sample.shape[-1]))
    shape = tuple(activation.shape[1:])
    conv = channels_first_hint(dict(model.named_modules())[str(args.layer)], shape[0])
    grid = decide_grid(shape, image, Layout(args.layout), prefix, key, conv)
    converted = to_channels_first(activation, grid.layout, grid.prefix_tokens, grid.size)
    return LayerSample(grid, converted, logits, activation)


def as_float(tensor: torch.Tensor) -> torch.Tensor:
    """A capture in a float at least as wide as float32, for the maps' sums: float16 and
    bfloat16 are widened exactly (the one rounding is when the map is stored), float64
    stays."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _channels_first(records: Mapping[str, torch.Tensor], key: str, grid: Grid) -> torch.Tensor:
    return to_channels_first(as_float(records[key]), grid.layout, grid.prefix_tokens, grid.size)


def _grad_cam(activation: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    alpha = gradient.mean(dim=(2, 3), keepdim=True)
    return torch.relu((alpha * activation).sum(dim=1))


@register_method("grad_cam")
class GradCAM(Method):
    Args = CamArgs

    def requires(self, args: CamArgs) -> list[str]:
        return [
            layout.capture_key(args.layer, "output"),
            layout.capture_key(args.layer, "grad_output"),
        ]

    def prepare(self, args: CamArgs, model: nn.Module, sample: torch.Tensor) -> Grid:
        return layer_grid(args, model, sample, self.name)[0]

    def maps(
        self, args: CamArgs, state: Grid, records: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's activation and its gradient, both as (N, C, H, W) floats."""
        activation = _channels_first(records, layout.capture_key(args.layer, "output"), state)
        gradient = _channels_first(records, layout.capture_key(args.layer, "grad_output"), state)
        return activation, gradient

    def compute(self, args: CamArgs, state: Grid, records: Mapping[str, torch.Tensor]) -> Any:
        return _grad_cam(*self.maps(args, state, records))

    def stored_shapes(
        self, args: CamArgs, state: Grid, key: str, sample: tuple[int, ...]
    ) -> dict[str, tuple[int, ...]]:
        return {key: state.size}  # (N, H, W) at the layer's grid


@register_method("cam")
class CAM(Method):
    Args = CamArgs
    needs_class = True

    def requires(self, args: CamArgs) -> list[str]:
        return [layout.capture_key(args.layer, "output")]

    def prepare(
        self, args: CamArgs, model: nn.Module, sample: torch.Tensor
    ) -> tuple[torch.Tensor, Grid]:
        return linear_head(model, args, sample), layer_grid(args, model, sample, self.name)[0]

    def compute(
        self, args: CamArgs, state: tuple[torch.Tensor, Grid], records: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        weights, grid = state
        activation = _channels_first(records, layout.capture_key(args.layer, "output"), grid)
        targets = records[layout.SAMPLES_TARGET].to(weights.device)
        w = weights[targets].to(activation.device, activation.dtype)  # (N, C)
        return torch.einsum("nc,nchw->nhw", w, activation)

    def stored_shapes(
        self, args: CamArgs, state: tuple[torch.Tensor, Grid], key: str, sample: tuple[int, ...]
    ) -> dict[str, tuple[int, ...]]:
        return {key: state[1].size}


@register_method("guided_grad_cam")
class GuidedGradCAM(GradCAM):
    def requires(self, args: LayerArgs) -> list[str]:
        return [*super().requires(args), layout.INPUT_GRAD]

    def compute(
        self, args: LayerArgs, state: Any, records: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        cam = super().compute(args, state, records)
        guided = as_float(records[layout.INPUT_GRAD]).to(cam.device)
        up = F.interpolate(cam[:, None], size=guided.shape[-2:], mode="bilinear")
        return guided * up

    def stored_shapes(
        self, args: LayerArgs, state: Any, key: str, sample: tuple[int, ...]
    ) -> dict[str, tuple[int, ...]]:
        return {key: sample}  # the input's guided gradient, weighted


def linear_head(
    model: nn.Module, args: CamArgs, sample: torch.Tensor, method: str = "cam"
) -> torch.Tensor:
    """The class weights (K, C) of a model that ends in global average pooling over
    `args.layer` (in any layout) followed by one linear layer; HookrunError for any other.

    Checked numerically on one sample: the model's logits must equal the last nn.Linear
    applied to the spatial mean of the layer's output.
    """
    layer = str(args.layer)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    _, activation, logits, _ = layer_grid(args, model, sample, method)
    why = ""
    if not linears:
        why = "it has no nn.Linear layer"
    else:
        name, fc = linears[-1]
        try:
            expected = fc(activation.mean(dim=(2, 3)))
        except RuntimeError:
            expected = None
        if expected is None or expected.shape != logits.shape:
            why = f"its last linear layer '{name}' does not take '{layer}'s channels"
        elif not torch.allclose(expected, logits, rtol=1e-3, atol=1e-3 * logits.abs().max()):
            why = f"more than global average pooling + '{name}' follows '{layer}'"
        else:
            return as_float(fc.weight.detach())
    raise HookrunError(
        f"derive.{method}.layer: CAM is undefined for this model at {layer!r}: {why}; valid: a "
        "model ending in global average pooling + one linear layer (resnet*, mobilenet_v2, "
        "swin_t at norm, digits_cnn), or experiment=grad_cam for any model"
    )
