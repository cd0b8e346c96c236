"""Model randomisation for the sanity check (Adebayo et al. 2018), and the model given back.

`sanity.layers: auto` randomises, in order: the output layer (the last module with weights
of its own to run: MobileNetV2's `classifier.1`, resnet's `fc`, ViT's `heads.head`), then the
blocks of the feature extractor from the last to the first. The blocks are the model's
top-level modules with weights, in the order they first run; in a model built as a feature
extractor and a head (at most three top-level modules with weights: MobileNetV2, VGG,
AlexNet, DenseNet, EfficientNet, ConvNeXt, Swin, RegNet, ViT) a top-level plain
`nn.Sequential` / `nn.ModuleList` is split into its children. So MobileNetV2: classifier.1,
features.18, …, features.0; resnet: fc, layer4, layer3, layer2, layer1, bn1, conv1.

A module is randomised by its own `reset_parameters()` (`_reset_parameters()` for
nn.MultiheadAttention) and `reset_running_stats()`, for it and every module inside it, each
seeded by (run seed, its qualified name): the same weights in every batch, run and process.
The randomised weights are drawn once; each step copies them in, and the original tensors
are copied back after every batch and when the run ends (runtime/hooks.py `weights_kept`).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hookrun.errors import HookrunError, nearest
from hookrun.runtime.handles import ModuleHook, hooked
from hookrun.signals import deferred

__all__ = ["default_layers", "check_layers", "Randomizer", "reset_seed"]

log = logging.getLogger("hookrun")

_PLAIN = (nn.Sequential, nn.ModuleList)
_RESETS = ("reset_parameters", "_reset_parameters", "reset_running_stats")


def _has_weights(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _run_order(model: nn.Module, sample: torch.Tensor) -> tuple[list[str], list[str]]:
    """(modules in the order they first start, modules with weights of their own in the
    order they finish) in one forward pass of `sample`."""
    started: dict[str, None] = {}
    finished: list[str] = []
    hooks = []
    for name, module in model.named_modules():
        if not name:
            continue
        hooks.append(ModuleHook(module, lambda *_, n=name: started.setdefault(n), before=True))
        if any(True for _ in module.parameters(recurse=False)):
            hooks.append(ModuleHook(module, lambda *_, n=name: finished.append(n)))
    with hooked(hooks), torch.no_grad():
        model(sample.unsqueeze(0))
    return list(started), finished


def default_layers(model: nn.Module, sample: torch.Tensor) -> list[str]:
    """`sanity.layers: auto` for `model` (rule in the module docstring); the model is in
    eval mode with frozen parameters."""
    started, finished = _run_order(model, sample)
    top = [(n, m) for n, m in model.named_children() if _has_weights(m)]
    blocks: list[str] = []
    for name, module in top:
        if len(top) <= 3 and type(module) in _PLAIN:
            blocks += [f"{name}.{c}" for c, child in module.named_children() if _has_weights(child)]
        else:
            blocks.append(name)
    place = {name: i for i, name in enumerate(started)}
    blocks = sorted((b for b in blocks if b in place), key=place.__getitem__)
    output = finished[-1:] if finished else []
    return output + [b for b in reversed(blocks) if b not in output]


def check_layers(model: nn.Module, layers: list[str]) -> None:
    """Refuse a `sanity.layers` entry that names no module, or one with nothing to redraw."""
    modules = dict(model.named_modules())
    for i, name in enumerate(layers):
        if name not in modules or not name:
            hint = nearest(name, [n for n in modules if n], n=3)
            raise HookrunError(
                f"sanity.layers[{i}]: {name!r} is not a module of the model; nearest: "
                f"{', '.join(hint) or 'none'} (see dry_run=true)"
            )
        if not any(hasattr(m, r) for m in modules[name].modules() for r in _RESETS):
            raise HookrunError(
                f"sanity.layers[{i}]: {name!r} has no parameters to randomise (no module in "
                "it has reset_parameters or reset_running_stats); valid: modules with weights"
            )


def reset_seed(seed: int, name: str) -> int:
    """The seed module `name` is redrawn with."""
    return (seed * 1_000_003 + zlib.crc32(f"sanity|{name}".encode())) % (2**63)


def _redraw(layer: nn.Module, prefix: str, seed: int) -> None:
    """Reset `layer` and every module inside it, each seeded by its qualified name."""
    devices = sorted({p.device.index or 0 for p in layer.parameters() if p.is_cuda})
    skipped = []
    for name, module in layer.named_modules(prefix=prefix):
        resets = [getattr(module, r) for r in _RESETS if hasattr(module, r)]
        if not resets and any(True for _ in module.parameters(recurse=False)):
            skipped.append(name)
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(reset_seed(seed, name))
            for reset in resets:
                reset()
    if skipped:
        log.warning("sanity: %s keep their weights (no reset_parameters)", ", ".join(skipped))


class Randomizer:
    """The randomised state of each layer, drawn once, and the original to copy back."""

    def __init__(self, model: nn.Module, layers: list[str], seed: int, cascading: bool) -> None:
        self.layers, self.cascading = layers, cascading
        self.state = {n: t for n, t in model.state_dict(keep_vars=True).items()}
        touched = {k for k in self.state for layer in layers if k.startswith(f"{layer}.")}
        self.original = {k: self.state[k].detach().clone() for k in touched}
        self.random: list[dict[str, torch.Tensor]] = []
        try:
            for layer in layers:
                _redraw(model.get_submodule(layer), layer, seed)
                keys = [k for k in touched if k.startswith(f"{layer}.")]
                self.random.append({k: self.state[k].detach().clone() for k in keys})
                self.restore()  # each layer is drawn from the original model
        finally:
            self.restore()

    def restore(self) -> None:
        """Every randomised tensor back to its original values (bit for bit)."""
        with torch.no_grad():
            for key, value in self.original.items():
                self.state[key].copy_(value)

    def apply(self, step: int) -> None:
        """The model of randomisation step `step` (0-based): cascading, layers 0..step are
        random; independent, only layer `step` is."""
        with torch.no_grad():
            if not self.cascading:
                self.restore()
            for key, value in self.random[step].items():
                self.state[key].copy_(value)

    @contextmanager
    def steps(self) -> Iterator[None]:
        """Randomise freely inside; the original model is back on exit, error or not."""
        try:
            yield
        finally:
            with deferred():  # a signal waits until the trained weights are back
                self.restore()
