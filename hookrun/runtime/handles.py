"""The one way hookrun puts a hook on a module: `hooked(hooks)` registers each for a block
of code and removes every one on the way out, by error or not (a signal waits until they
are off: signals.deferred). The runtime's own hooks (attach, the probe, function sites) and
every stage's passes of its own register here; tests/test_house.py checks that no other
module calls torch's registration."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from hookrun.signals import deferred

__all__ = ["ModuleHook", "hooked", "output_hooks", "input_hooks"]


@dataclass(frozen=True)
class ModuleHook:
    """One hook: `fn(module, args, output)` after `module` runs (a forward hook), or
    `fn(module, args)` before it (`before`: a forward pre-hook); either may return the
    replacement. `prepend`: ahead of the module's other hooks of that kind. `kwargs`: the
    call's keyword arguments too, `fn(module, args, kwargs, output)` (`fn(module, args,
    kwargs)` before it), as torch's `with_kwargs=True` hands them."""

    module: nn.Module
    fn: Callable[..., Any]
    before: bool = False
    prepend: bool = False
    kwargs: bool = False


@contextmanager
def hooked(hooks: Iterable[ModuleHook]) -> Iterator[list[RemovableHandle]]:
    """Every hook registered for the block, in order; each one removed on exit."""
    handles: list[RemovableHandle] = []
    try:
        for hook in hooks:
            register = (
                hook.module.register_forward_pre_hook
                if hook.before
                else hook.module.register_forward_hook
            )
            handles.append(register(hook.fn, prepend=hook.prepend, with_kwargs=hook.kwargs))
        yield handles
    finally:
        with deferred():  # a signal now waits until every hook is off
            for handle in handles:
                handle.remove()
            handles.clear()


def output_hooks(
    model: nn.Module, names: Iterable[str], make: Callable[[str], Callable[..., Any]]
) -> list[ModuleHook]:
    """A forward hook `make(name)` on each module of `model` called `name`."""
    modules = dict(model.named_modules())
    return [ModuleHook(modules[name], make(name)) for name in names]


def input_hooks(
    model: nn.Module, names: Iterable[str], make: Callable[[str], Callable[..., Any]]
) -> list[ModuleHook]:
    """A forward pre-hook `make(name)` on each module of `model` called `name`."""
    modules = dict(model.named_modules())
    return [ModuleHook(modules[name], make(name), before=True) for name in names]
