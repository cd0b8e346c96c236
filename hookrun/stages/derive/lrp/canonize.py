"""Canonizers: the model rewritten, for the LRP passes only, into a form each rule can stand
on — as Zennit 0.5.1's canonizers do (`zennit/canonizers.py`, `zennit/torchvision.py`):

- every batch norm that directly follows a convolution or linear layer (in the order of the
  model's leaf modules: SequentialMergeBatchNorm) merged into that layer's weight and bias,
  the batch norm itself set to pass its input on (mean 0, variance 1, weight 1, bias 0);
- torchvision's ResNet blocks (BasicBlock, Bottleneck) given an explicit `Sum` module for
  the residual sum (ResNetCanonizer), so the sum's relevance is split by the norm rule.

`canonized(model)` does both for a block of code and puts every parameter, buffer and
attribute back as it came — the same tensors, so bit for bit — on every exit path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hookrun.signals import deferred

__all__ = ["Sum", "canonized", "merge_pairs"]

_LINEAR = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
_BATCH_NORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


class Sum(nn.Module):
    """The sum over the last axis: a residual block's branches, stacked, added up."""

    def forward(self, stacked: torch.Tensor) -> torch.Tensor:
        """The stacked branches (…, k) summed to (…)."""
        return torch.sum(stacked, dim=-1)


def _leaves(module: nn.Module) -> Iterator[nn.Module]:
    """The modules without children, in the model's order (Zennit's collect_leaves)."""
    children = False
    for child in module.children():
        children = True
        yield from _leaves(child)
    if not children:
        yield module


def merge_pairs(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(layer, batch norm) for every batch norm whose leaf before it is a linear layer."""
    pairs, last = [], None
    for leaf in _leaves(model):
        if isinstance(last, _LINEAR) and isinstance(leaf, _BATCH_NORM):
            pairs.append((last, leaf))
        last = leaf
    return pairs


def _merge(linear: nn.Module, norm: nn.Module) -> None:
    """Zennit's merge_batch_norm, on new tensors (the old ones are kept by the caller)."""
    scale = norm.weight / (norm.running_var + norm.eps) ** 0.5
    weight = linear.weight.data
    bias = (
        torch.zeros(1, device=weight.device, dtype=weight.dtype)
        if linear.bias is None
        else linear.bias.data
    )
    if isinstance(linear, _TRANSPOSED):
        index = (None, slice(None), *((None,) * (weight.ndim - 2)))
    else:
        index = (slice(None), *((None,) * (weight.ndim - 1)))
    with torch.no_grad():
        linear.weight = nn.Parameter(weight * scale[index], requires_grad=False)
        linear.bias = nn.Parameter(
            (bias - norm.running_mean) * scale + norm.bias, requires_grad=False
        )
        norm.running_mean = torch.zeros_like(norm.running_mean)
        norm.running_var = torch.ones_like(norm.running_var)
        norm.weight = nn.Parameter(torch.ones_like(norm.weight), requires_grad=False)
        norm.bias = nn.Parameter(torch.zeros_like(norm.bias), requires_grad=False)


def _basic_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """torchvision's BasicBlock.forward with the residual sum as a module (ResNetCanonizer)."""
    identity = x
    out = self.relu(self.bn1(self.conv1(x)))
    out = self.bn2(self.conv2(out))
    if self.downsample is not None:
        identity = self.downsample(x)
    return self.relu(self.canonizer_sum(torch.stack([identity, out], dim=-1)))


def _bottleneck_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """torchvision's Bottleneck.forward with the residual sum as a module."""
    identity = x
    out = self.relu(self.bn1(self.conv1(x)))
    out = self.relu(self.bn2(self.conv2(out)))
    out = self.bn3(self.conv3(out))
    if self.downsample is not None:
        identity = self.downsample(x)
    return self.relu(self.canonizer_sum(torch.stack([identity, out], dim=-1)))


def _residual_blocks(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """torchvision's ResNet blocks and their canonical forward (none without torchvision's)."""
    try:
        from torchvision.models.resnet import BasicBlock, Bottleneck
    except ImportError:  # a model of the caller's without torchvision installed
        return []
    forwards = {BasicBlock: _basic_forward, Bottleneck: _bottleneck_forward}
    return [(m, forwards[type(m)]) for m in model.modules() if type(m) in forwards]


_KEPT = ("weight", "bias")
_KEPT_NORM = ("weight", "bias", "running_mean", "running_var")


@contextmanager
def canonized(model: nn.Module, merge: bool = True) -> Iterator[list[str]]:
    """The model canonized for the block; yields what was done, one line each (the plan's).

    Parameters and buffers are replaced, never written into: the originals are put back on
    the way out (the same tensors), with each block's own forward and no `canonizer_sum`.
    """
    names = {m: n for n, m in model.named_modules()}
    kept: list[tuple[nn.Module, str, Any]] = []
    blocks: list[nn.Module] = []
    lines: list[str] = []
    try:
        if merge:
            for linear, norm in merge_pairs(model):
                kept += [(linear, k, getattr(linear, k)) for k in _KEPT]
                kept += [(norm, k, getattr(norm, k)) for k in _KEPT_NORM]
                _merge(linear, norm)
                lines.append(f"{names[norm]} merged into {names[linear]}")
        for block, forward in _residual_blocks(model):
            blocks.append(block)
            block.canonizer_sum = Sum()
            block.forward = forward.__get__(block)
            lines.append(f"{names[block]}: residual sum as {names[block]}.canonizer_sum")
        yield lines
    finally:
        with deferred():  # a signal waits until the model is whole again
            for block in blocks:
                del block.forward
                del block.canonizer_sum
            for module, key, value in reversed(kept):
                # A layer had no bias: the merge gave it one, which goes again.
                setattr(module, key, value)
