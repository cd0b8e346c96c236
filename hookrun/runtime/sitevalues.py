"""The tensors at a few sites of one forward pass, taken by forward hooks, the forward stopped
after the last of them (nothing after the last site is computed: a language model's
unembedding, a classifier's head).

A job that reads activations without the rows' pipeline (training a dictionary from the
model's stream, reading every unit of a site over a corpus) takes them here; the hooks go
through `hooked`, so every one is off again on every exit path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hookrun.errors import HookrunError
from hookrun.runtime.handles import ModuleHook, hooked

__all__ = ["SiteRead", "site_tensor", "take_sites", "modules_of"]


class _Stop(Exception):  # noqa: N818  (not an error: the forward has given every site)
    """Raised by the last site's hook: nothing after it is needed."""


@dataclass(frozen=True)
class SiteRead:
    """One site read: a module (by name) at its `input` or `output`. `with_input`: at an
    output, the call's first input is taken too (what a transcoder reads)."""

    module: str
    at: str
    with_input: bool = False


def site_tensor(value: object) -> torch.Tensor:
    """A module's output (or args) as the tensor a site means (a tuple: its first tensor)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    raise HookrunError(f"a site's value is a {type(value).__name__}, not a tensor")


def modules_of(model: nn.Module, names: Sequence[str], key: str) -> list[nn.Module]:
    """The modules called `names`, or one line naming the first the model lacks."""
    modules = dict(model.named_modules())
    missing = [m for m in names if m not in modules]
    if missing:
        names_there = [n for n in modules if n]
        shown = ", ".join(names_there[len(names_there) // 2 : len(names_there) // 2 + 3])
        raise HookrunError(
            f"{key}: the model has no module {missing[0]!r}; valid: a module of "
            f"model.named_modules(), e.g. {shown}"
        )
    return [modules[m] for m in names]


def take_sites(
    model: nn.Module,
    sites: Sequence[SiteRead],
    call: Callable[[], object],
    key: str,
    keep: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Run `call()` (a forward of `model`) with a hook at every site; the forward stops once
    the last site has given its tensor.

    Args:
        model: The model `call` runs.
        sites: The sites, in any order (each taken at its module's first call).
        call: Runs the forward pass.
        key: The config key a site that never ran is named under.
        keep: What is kept of each tensor (default: a detached copy, so an in-place module
            after the site, ReLU(inplace=True), cannot change it); the identity keeps the
            autograd graph (a gradient w.r.t. the input).

    Returns:
        (tensor, the call's first input or None) per site, in the order of `sites`.

    Raises:
        HookrunError: a site whose module never ran in the forward pass.
    """
    keep = keep or (lambda t: t.detach().clone())
    modules = modules_of(model, [s.module for s in sites], key)
    taken: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def hook(i: int, site: SiteRead) -> Callable[..., None]:
        def fn(module: nn.Module, args: tuple, output: object = None) -> None:
            if i in taken:  # a module called twice: its first call is the site
                return None
            value = site_tensor(args) if site.at == "input" else site_tensor(output)
            given = keep(site_tensor(args)) if site.with_input else None
            taken[i] = (keep(value), given)
            if len(taken) == len(sites):
                raise _Stop
            return None

        return fn

    hooks = [
        ModuleHook(module, hook(i, site), before=site.at == "input")
        for i, (module, site) in enumerate(zip(modules, sites, strict=True))
    ]
    with hooked(hooks), contextlib.suppress(_Stop):
        call()
    missing = [f"{s.module}:{s.at}" for i, s in enumerate(sites) if i not in taken]
    if missing:
        raise HookrunError(
            f"{key}: {missing[0]} never ran in the model's forward pass; valid: a module the "
            "forward calls"
        )
    return [taken[i] for i in range(len(sites))]
