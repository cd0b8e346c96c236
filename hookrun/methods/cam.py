"""CAM-family methods at one layer (`derive.<method>.layer`, the presets' model.cam_layer):
- grad_cam: relu(Σ_k α_k A^k), α_k = spatial mean of ∂y_c/∂A^k (Selvaraju et al. 2017).
- cam: Σ_k w_ck A^k with w_c the target class's row of the final linear layer (Zhou et al.
  2016); only for models that end in global average pooling + one linear layer.
- guided_grad_cam: the input's Guided Backprop gradient times Grad-CAM upsampled to the
  input's size (bilinear), as in the Grad-CAM paper.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.methods.registry import LayerArgs, Method, register_method

__all__ = ["GradCAM", "CAM", "GuidedGradCAM", "linear_head"]


def _grad_cam(activation: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    alpha = gradient.float().mean(dim=(2, 3), keepdim=True)
    return torch.relu((alpha * activation.float()).sum(dim=1))


@register_method("grad_cam")
class GradCAM(Method):
    def requires(self, args: LayerArgs) -> list[str]:
        return [
            layout.capture_key(args.layer, "output"),
            layout.capture_key(args.layer, "grad_output"),
        ]

    def compute(
        self, args: LayerArgs, state: Any, records: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        activation = records[layout.capture_key(args.layer, "output")]
        gradient = records[layout.capture_key(args.layer, "grad_output")]
        return _grad_cam(activation, gradient)


@register_method("cam")
class CAM(Method):
    needs_class = True

    def requires(self, args: LayerArgs) -> list[str]:
        return [layout.capture_key(args.layer, "output")]

    def prepare(self, args: LayerArgs, model: nn.Module, sample: torch.Tensor) -> torch.Tensor:
        return linear_head(model, str(args.layer), sample)

    def compute(
        self, args: LayerArgs, state: Any, records: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        w = state[records[layout.SAMPLES_TARGET]]  # (N, C)
        activation = records[layout.capture_key(args.layer, "output")]
        return torch.einsum("nc,nchw->nhw", w, activation.float())


@register_method("guided_grad_cam")
class GuidedGradCAM(GradCAM):
    def requires(self, args: LayerArgs) -> list[str]:
        return [*super().requires(args), layout.INPUT_GRAD]

    def compute(
        self, args: LayerArgs, state: Any, records: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        cam = super().compute(args, state, records)
        guided = records[layout.INPUT_GRAD].float()
        up = F.interpolate(cam[:, None], size=guided.shape[-2:], mode="bilinear")
        return guided * up


def linear_head(
    model: nn.Module, layer: str, sample: torch.Tensor, method: str = "cam"
) -> torch.Tensor:
    """The class weights (K, C) of a model that ends in global average pooling over `layer`
    followed by one linear layer; HookrunError for any other model.

    Checked numerically on one sample: the model's logits must equal the last nn.Linear
    applied to the spatial mean of `layer`'s output.
    """
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    seen: dict[str, Any] = {}
    module = dict(model.named_modules())[layer]
    handle = module.register_forward_hook(lambda m, i, o: seen.setdefault("a", o.detach().clone()))
    try:
        with torch.no_grad():
            logits = model(sample.unsqueeze(0))
    finally:
        handle.remove()
    activation = seen.get("a")
    why = ""
    if not linears:
        why = "it has no nn.Linear layer"
    elif activation is None or activation.dim() != 4:
        why = f"'{layer}' does not output (N, C, H, W) feature maps"
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
            return fc.weight.detach().float().cpu()
    raise HookrunError(
        f"derive.{method}.layer: CAM is undefined for this model at {layer!r}: {why}; valid: a "
        "model ending in global average pooling + one linear layer (resnet*, mobilenet_v2, "
        "digits_cnn), or experiment=grad_cam for any CNN"
    )
