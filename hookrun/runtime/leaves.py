"""The floating-point tensors of a module's arguments or output, leaf by leaf, each with the
suffix that names it in captures.h5, and the same structure rebuilt with new tensors.

Suffixes: a lone tensor has none; a flat tuple/list of several tensors numbers its
floating-point ones `_0`, `_1`, ... (as since 0.1); a dict, a namedtuple or a Hugging Face
style `ModelOutput` (a dict subclass) names each entry `.<key>`; nested structures join
their suffixes (`.hidden_0`). Non-float leaves (masks, indices) are neither captured nor
changed, nor are parameters passed as arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hookrun.errors import HookrunError

__all__ = ["leaves", "rebuild", "model_logits"]


def _is_float(value: Any) -> bool:
    # Parameters handed to a function (F.linear's weight) are the model's state, not a site.
    floating = isinstance(value, torch.Tensor) and value.is_floating_point()
    return floating and not isinstance(value, nn.Parameter)


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _children(value: Any) -> list[tuple[str, Any]] | None:
    """(suffix, child) of a container, None for a leaf."""
    if isinstance(value, Mapping):
        return [(f".{k}", v) for k, v in value.items()]
    if _is_namedtuple(value):
        return [(f".{f}", getattr(value, f)) for f in value._fields]
    if isinstance(value, (tuple, list)):
        if not any(isinstance(v, (tuple, list, Mapping)) for v in value):  # flat: 0.1 names
            floats = [i for i, v in enumerate(value) if _is_float(v)]
            many = len(floats) > 1
            names = {i: (f"_{n}" if many else "") for n, i in enumerate(floats)}
            return [(names.get(i, f"_{i}"), v) for i, v in enumerate(value)]
        return [(f"_{i}", v) for i, v in enumerate(value)]
    return None


def leaves(value: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(suffix, tensor) for every floating-point tensor in `value`, in order."""
    if _is_float(value):
        return [(prefix, value)]
    children = _children(value)
    if children is None:
        return []
    out: list[tuple[str, torch.Tensor]] = []
    for suffix, child in children:
        out += leaves(child, prefix + suffix)
    return out


def rebuild(value: Any, new: Mapping[str, torch.Tensor], prefix: str = "") -> Any:
    """`value` with each floating-point leaf replaced by `new[suffix]` (kept where absent)."""
    if _is_float(value):
        return new.get(prefix, value)
    children = _children(value)
    if children is None:
        return value
    items = [rebuild(child, new, prefix + suffix) for suffix, child in children]
    if isinstance(value, Mapping):
        entries = dict(zip(value.keys(), items, strict=True))
        if type(value) is dict:
            return entries
        try:
            return type(value)(**entries)  # a ModelOutput dataclass keeps its class
        except TypeError:
            return type(value)(entries)
    if _is_namedtuple(value):
        return type(value)(*items)
    return type(value)(items) if isinstance(value, tuple) else items


def model_logits(output: Any) -> torch.Tensor:
    """The tensor a model's output holds its class scores in: the output itself, the
    `logits` entry of a dict / namedtuple / ModelOutput, or the first item of a tuple
    (torchvision's aux-logit models); HookrunError otherwise."""
    if isinstance(output, torch.Tensor):
        return output
    named = dict(leaves(output))
    if ".logits" in named:
        return named[".logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise HookrunError(
        f"model: the model returned a {type(output).__name__} with no `logits` entry "
        f"(floating-point leaves: {', '.join(named) or 'none'}); valid: a tensor (N, ...), or "
        "a dict / namedtuple / ModelOutput with `logits`"
    )
