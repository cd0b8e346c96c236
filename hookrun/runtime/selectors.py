"""Which modules a hook's `select:` block matches.

Keys combine with AND, entries inside one key's list with OR. Names are qualified module
names as `model.named_modules()` gives them; `input` is the model-input pseudo-layer, only
ever matched by that exact name.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from hookrun.errors import HookrunError, nearest
from hookrun.typed import Frozen, import_class

__all__ = ["INPUT_LAYER", "SelectConfig", "select_layers", "resolve_type"]


@dataclass
class SelectConfig(Frozen):
    name: Any = None
    """Globs over qualified module names (`*` crosses dots, never matches the root); `input` names
    the model-input pseudo-layer.
    """
    regex: Any = None
    """Regular expressions, full match."""
    type: Any = None
    """Class names: short torch.nn names (ReLU) or dotted import paths."""
    exclude: Any = None
    """Globs to drop from what the other keys matched."""
    function: Any = None
    """Functions called inside forward (relu, gelu, linear, softmax, ...; hookrun/runtime/
    functions.py): each call is a site `<module>/<function>.<k>`; with name/type/regex, only
    calls made inside the modules those match.
    """


INPUT_LAYER = "input"


def _as_list(value: object, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return list(value)
    raise HookrunError(f"{key}: {value!r} is not a string or a list of strings")


def resolve_type(name: str, key: str) -> type:
    """A class from a short torch.nn name (`ReLU`) or a dotted import path."""
    if "." not in name:
        cls = getattr(nn, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls
        known = [n for n in dir(nn) if isinstance(getattr(nn, n), type)]
        hint = ", ".join(nearest(name, known)) or "ReLU, Conv2d, Linear"
        raise HookrunError(
            f"{key}: {name!r} is not a torch.nn module class; did you mean: {hint} "
            "(or give a dotted path such as torchvision.ops.misc.Conv2dNormActivation)"
        )
    return import_class(name, key, nn.Module)


def _glob(pattern: str, name: str) -> bool:
    # fnmatchcase: `*` crosses dots, so `layer1.*` matches layer1.0 and layer1.0.conv1.
    return fnmatch.fnmatchcase(name, pattern)


def select_layers(select: SelectConfig, model: nn.Module, key: str) -> list[str]:
    """Qualified names of the modules `select` matches, in `named_modules()` order.

    `key` is the config path of the select block, used in error messages. A selector that
    matches nothing raises HookrunError listing the nearest module names.
    """
    names = _as_list(select.name, f"{key}.name")
    regexes = _as_list(select.regex, f"{key}.regex")
    types = _as_list(select.type, f"{key}.type")
    excludes = _as_list(select.exclude, f"{key}.exclude")
    if not (names or regexes or types):
        raise HookrunError(f"{key}: select nothing; give at least one of name, regex, type")

    compiled = []
    for pattern in regexes:
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            raise HookrunError(f"{key}.regex: {pattern!r} is not a valid regex ({err})") from None
    classes = tuple(resolve_type(t, f"{key}.type") for t in types)

    chosen: list[str] = []
    # The pseudo-layer is chosen by name alone; a type or regex never selects it.
    if INPUT_LAYER in names and not (regexes or types):
        chosen.append(INPUT_LAYER)
    for qualified, module in model.named_modules():
        if qualified == "":  # the root is the whole model, never a layer
            continue
        if names and not any(_glob(p, qualified) for p in names if p != INPUT_LAYER):
            continue
        if compiled and not any(r.fullmatch(qualified) for r in compiled):
            continue
        if classes and not isinstance(module, classes):
            continue
        chosen.append(qualified)
    chosen = [n for n in chosen if not any(_glob(p, n) for p in excludes)]
    if not chosen:
        shown = {k: v for k, v in vars(select).items() if v is not None and k[0] != "_"}
        raise HookrunError(f"{key}: {shown} matches no module of the model; {_hint(select, model)}")
    return chosen


def _hint(select: SelectConfig, model: nn.Module) -> str:
    """What the model does have: its module classes for a type selector (a grad_scale
    written for ReLU on a SiLU model), else the module names nearest the pattern."""
    if select.type and not (select.name or select.regex):
        present = dict.fromkeys(type(m).__name__ for n, m in model.named_modules() if n)
        return f"the model's module types: {', '.join(present)}"
    all_names = [n for n, _ in model.named_modules() if n] + [INPUT_LAYER]
    probe = (_as_list(select.name, "") or _as_list(select.regex, "") or [""])[0]
    hint = nearest(probe, all_names, n=8) or all_names[:8]
    return f"nearest names: {', '.join(hint)}"
