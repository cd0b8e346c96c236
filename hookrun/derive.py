"""Results computed per batch from captured tensors: /derived/<method>/<layer>.

Each method is raw — at the layer's resolution, not normalised — so the file holds the
numbers and the pictures are a view of them (hookrun/render.py):
- grad_cam: relu(Σ_k α_k A^k), α_k = spatial mean of ∂y_c/∂A^k (Selvaraju et al. 2017).
- cam: Σ_k w_ck A^k with w_c the target class's row of the final linear layer (Zhou et al.
  2016); only for models that end in global average pooling + one linear layer.
- guided_grad_cam: the input's Guided Backprop gradient times Grad-CAM upsampled to the
  input's size (bilinear), as in the Grad-CAM paper.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookrun.errors import HookrunError
from hookrun.selectors import INPUT_LAYER

__all__ = ["METHODS", "Derivation", "plan_derivations", "derive", "linear_head"]

METHODS = ("grad_cam", "cam", "guided_grad_cam")


@dataclass(frozen=True)
class Derivation:
    """One derived result: its method, its layer, and (for CAM) the class weights."""

    method: str
    layer: str
    class_weights: torch.Tensor | None = None

    @property
    def key(self) -> str:
        return f"derived/{self.method}/{self.layer}"

    @property
    def requires(self) -> list[str]:
        """The capture datasets this method reads."""
        activation = f"captures/{self.layer}/output"
        if self.method == "cam":
            return [activation]
        needs = [activation, f"captures/{self.layer}/grad_output"]
        if self.method == "guided_grad_cam":
            needs.append(f"captures/{INPUT_LAYER}/grad_output")
        return needs


def _grad_cam(activation: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    alpha = gradient.float().mean(dim=(2, 3), keepdim=True)
    return torch.relu((alpha * activation.float()).sum(dim=1))


def derive(derivations: list[Derivation], records: Mapping[str, torch.Tensor]) -> dict:
    """The derived tensors for one batch of records, keyed by their HDF5 paths."""
    out: dict[str, torch.Tensor] = {}
    for d in derivations:
        activation = records[f"captures/{d.layer}/output"]
        if d.method == "cam":
            assert d.class_weights is not None
            w = d.class_weights[records["samples/target"]]  # (N, C)
            out[d.key] = torch.einsum("nc,nchw->nhw", w, activation.float())
            continue
        cam = _grad_cam(activation, records[f"captures/{d.layer}/grad_output"])
        if d.method == "grad_cam":
            out[d.key] = cam
        else:
            guided = records[f"captures/{INPUT_LAYER}/grad_output"].float()
            up = F.interpolate(cam[:, None], size=guided.shape[-2:], mode="bilinear")
            out[d.key] = guided * up
    return out


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


def plan_derivations(
    derive_cfg: Mapping[str, Any],
    capture_keys: set[str],
    model: nn.Module,
    sample: torch.Tensor,
    target_kind: str,
) -> list[Derivation]:
    """Check each `derive:` entry against the captures the plan makes; build its Derivation."""
    out = []
    for method, spec in derive_cfg.items():
        key = f"derive.{method}"
        if method not in METHODS:
            raise HookrunError(f"{key}: {method!r} is not a method; valid: {', '.join(METHODS)}")
        layer = (spec or {}).get("layer")
        if not layer:
            raise HookrunError(
                f"{key}.layer: {layer!r}; name the layer, e.g. model.cam_layer=layer4 "
                "(the model presets set it)"
            )
        weights = None
        if method == "cam":
            if target_kind in ("sum", "none"):
                raise HookrunError(
                    f"target.kind: {target_kind!r} has no class for CAM; valid: predicted, "
                    "label, index"
                )
            weights = linear_head(model, layer, sample)
        derivation = Derivation(method, layer, weights)
        missing = [k for k in derivation.requires if k not in capture_keys]
        if missing:
            raise HookrunError(
                f"{key}: needs the captures {', '.join('/' + k for k in missing)}; add hooks "
                "that capture them (see conf/experiment/grad_cam.yaml)"
            )
        out.append(derivation)
    return out
