"""`model.cam_layer: auto` (the default): the CAM layer picked by a probe of one sample.

The pick is the last module to finish (in forward order) whose output is a spatial map —
a layout `decide_grid` can tell — and through which the target logit's gradient reaches
more than one cell of the grid (or the grid is a single cell), up to the global pooling
(the first adaptive pooling after which no map has more than one cell): then the head.
Pooling modules and Linear layers (projections such as a ViT block's qkv, not the token
stream) are skipped.
So a CNN gets its last feature maps (resnet: layer4), Swin its channels-last `norm`/`permute`,
and ViT the last module before the final attention (encoder_layer_11.ln_1): after that
attention only the class token reaches the head, and Grad-CAM there would be all zeros.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from hookrun.config.build import RunSpec
from hookrun.errors import HookrunError
from hookrun.models.adapter import adapt
from hookrun.runtime.handles import hooked, output_hooks
from hookrun.runtime.hooks import run_mode
from hookrun.runtime.hookspec import says_auto, with_layer
from hookrun.runtime.spatial import (
    Layout,
    channels_first_hint,
    decide_grid,
    to_channels_first,
)
from hookrun.stage import stages
from hookrun.typed import freeze

__all__ = ["pick_cam_layer", "resolve_cam_layer"]

log = logging.getLogger("hookrun")


def _candidates(model: nn.Module, sample: torch.Tensor) -> list[tuple[str, Any, torch.Tensor]]:
    """(name, grid, output) of every module with a spatial tensor output, in finishing order,
    with each output's gradient from the top logit (held in a dict filled by backward)."""
    image = (int(sample.shape[-2]), int(sample.shape[-1]))
    prefix = adapt(model).prefix_tokens()
    found: list[tuple[str, Any, torch.Tensor]] = []
    pools: list[int] = []  # where adaptive poolings happened, as positions in `found`

    def keep(name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if type(module).__name__.startswith("Adaptive"):
                pools.append(len(found))
            if not (isinstance(output, torch.Tensor) and output.is_floating_point()):
                return
            if "Pool" in type(module).__name__ or not output.requires_grad or output.dim() < 3:
                return
            if isinstance(module, nn.Linear):
                return  # a projection inside attention/MLP (qkv), not the token stream

            try:
                shape = tuple(output.shape[1:])
                conv = channels_first_hint(module, shape[0])
                grid = decide_grid(shape, image, Layout.auto, prefix, "", conv)
            except HookrunError:
                return
            grad = torch.zeros_like(output)

            def copy(g: torch.Tensor) -> None:
                grad.copy_(g)

            output.register_hook(copy)
            found.append((name, grid, grad))

        return hook

    names = [name for name, _ in model.named_modules() if name]
    with hooked(output_hooks(model, names, keep)), run_mode(model), torch.enable_grad():
        x = sample.unsqueeze(0).detach().requires_grad_(True)
        out = model(x)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.reshape(-1).max().backward()
    # The head begins at the first adaptive pooling after which no map has more than one
    # cell (a squeeze-excitation block's pooling is followed by more maps).
    for at in pools:
        if all(math.prod(grid.size) == 1 for _, grid, _ in found[at:]):
            return found[:at]
    return found


def pick_cam_layer(model: nn.Module, sample: torch.Tensor) -> str:
    """The module `model.cam_layer: auto` stands for; HookrunError when none has a spatial
    output the target's gradient reaches."""
    candidates = _candidates(model, sample)
    for name, grid, grad in reversed(candidates):
        cells = to_channels_first(grad, grid.layout, grid.prefix_tokens, grid.size)
        reached = cells.abs().sum(dim=1) > 0  # (1, H, W)
        if reached.numel() == 1 or int(reached.sum()) > 1:
            return name
    why = (
        f"the target's gradient is zero on all {len(candidates)} spatial maps (an all-zero "
        "head, as torchvision's default init of ViT's, gives every method zeros)"
        if candidates and not any(bool(g.any()) for _, _, g in candidates)
        else "no module has a spatial output ((N, C, H, W), (N, H, W, C) or (N, L, D) "
        "tokens) that the target's gradient reaches"
    )
    raise HookrunError(
        f"model.cam_layer: 'auto' cannot pick a layer: {why}; valid: model.cam_layer=NAME "
        "(see dry_run=true for the module names)"
    )


def resolve_cam_layer(spec: RunSpec, model: nn.Module, sample: torch.Tensor) -> RunSpec:
    """`spec` with every `auto` layer (hook selectors, and each stage's that says so,
    Stage.says_auto) replaced by the picked module, as a new spec; the same spec when
    nothing says auto."""
    active = [(s, spec.stage(s.node)) for s in stages() if s.node and spec.stage(s.node)]
    if not (says_auto(spec.hooks) or any(s.says_auto(config) for s, config in active)):
        return spec
    layer = pick_cam_layer(model, sample)
    log.info("model.cam_layer=auto: the probe picked %r (set model.cam_layer to choose)", layer)
    resolved = {s.node: freeze(s.resolve_layer(config, layer)) for s, config in active}
    return dataclasses.replace(
        spec,
        hooks=with_layer(spec.hooks, layer),
        model=freeze(dataclasses.replace(spec.model, cam_layer=layer)),
        stages=MappingProxyType({**spec.stages, **resolved}),
    )
