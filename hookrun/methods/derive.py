"""Results computed per batch from captured tensors: /derived/<method>/<layer>.

Each method is raw — at the layer's resolution, not normalised — so the file holds the
numbers and the pictures are a view of them (hookrun/render/):
- grad_cam: relu(Σ_k α_k A^k), α_k = spatial mean of ∂y_c/∂A^k (Selvaraju et al. 2017).
- cam: Σ_k w_ck A^k with w_c the target class's row of the final linear layer (Zhou et al.
  2016); only for models that end in global average pooling + one linear layer.
- guided_grad_cam: the input's Guided Backprop gradient times Grad-CAM upsampled to the
  input's size (bilinear), as in the Grad-CAM paper.

A new method is one class here registered with `@_method(name)`: its `Args` (what
`derive.<name>:` accepts), the captures it `requires`, an optional `prepare` on the model
before the first batch, and `compute` on one batch of records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.registry import Registry
from hookrun.typed import Frozen

__all__ = ["METHODS", "Method", "LayerArgs", "Derivation", "plan_derivations", "derive"]


@dataclass
class LayerArgs(Frozen):
    # The module whose captures the method reads (the experiments pass model.cam_layer).
    layer: str | None = None


class Method:
    """Base class: `name` is the config word under `derive:`, `Args` its arguments."""

    name: ClassVar[str]
    Args: ClassVar[type] = LayerArgs
    # Target kinds the method needs a class for (CAM reads the target's weights).
    needs_class: ClassVar[bool] = False

    def requires(self, args: Any) -> list[str]:
        """The capture datasets this method reads."""
        raise NotImplementedError

    def prepare(self, args: Any, model: nn.Module, sample: torch.Tensor) -> Any:
        """State computed once from the model before the first batch (None by default)."""
        return None

    def compute(self, args: Any, state: Any, records: Mapping[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


METHODS: Registry[Method] = Registry("a method")


def _method(name: str):
    def add(cls: type[Method]) -> type[Method]:
        cls.name = name
        METHODS.register(name)(cls())
        return cls

    return add


def _grad_cam(activation: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    alpha = gradient.float().mean(dim=(2, 3), keepdim=True)
    return torch.relu((alpha * activation.float()).sum(dim=1))


@_method("grad_cam")
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


@_method("cam")
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


@_method("guided_grad_cam")
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


@dataclass(frozen=True)
class Derivation:
    """One derived result of a run: its method, arguments and prepared state."""

    method: Method
    args: Any
    state: Any = None

    @property
    def key(self) -> str:
        return layout.derived_key(self.method.name, str(self.args.layer))


def plan_derivations(
    requests: Mapping[str, Any], capture_keys: set[str], model: nn.Module, sample: torch.Tensor
) -> list[Derivation]:
    """Each requested method (name → parsed Args) against the captures the plan makes; its
    state prepared on the model."""
    out = []
    for name, args in requests.items():
        method = METHODS.get(name, f"derive.{name}")
        missing = [k for k in method.requires(args) if k not in capture_keys]
        if missing:
            raise HookrunError(
                f"derive.{name}: needs the captures {', '.join('/' + k for k in missing)}; add "
                "hooks that capture them (see conf/experiment/grad_cam.yaml)"
            )
        out.append(Derivation(method, args, method.prepare(args, model, sample)))
    return out


def derive(derivations: list[Derivation], records: Mapping[str, torch.Tensor]) -> dict:
    """The derived tensors for one batch of records, keyed by their HDF5 paths."""
    return {d.key: d.method.compute(d.args, d.state, records) for d in derivations}
