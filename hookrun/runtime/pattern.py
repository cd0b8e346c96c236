"""`at: pattern`: an attention module's probabilities per head, (N, heads, query, key).

A pattern site is the softmax call that an attention module's own forward makes (eager
attention: GPT-2, Llama, GPT-NeoX and BERT compute `softmax(q·kᵀ/√d + mask)` inside the
module whose weights make q and k). The plan compiles it to a function site
(`select.function: softmax`, hookrun/runtime/functions.py) narrowed to the selected modules, so
the probe finds the call, and capture / zero / scale / patch act on the probabilities the rest
of the forward uses (head ablation). Its captures.h5 path is `/captures/<module>/pattern`
(io/layout.py `pattern_key`).

Fused attention (sdpa, flash) never forms the probabilities: a run with pattern sites
switches the model to eager attention and says so in the plan (models/adapter.py
`use_eager`), or refuses when the model cannot switch. A module whose forward calls no
softmax is not an attention module: refused naming the model's attention modules
(`bind_pattern`).
"""

from __future__ import annotations

from collections.abc import Iterable

from hookrun.errors import HookrunError

__all__ = ["WORD", "attention_modules", "bind_pattern"]

# The function word a pattern site compiles to.
WORD = "softmax"


def attention_modules(calls: Iterable[str]) -> list[str]:
    """The modules whose own forward calls softmax, from the probe's call sites
    (`<module>/softmax.<k>`), in the order they ran; the root's own calls excluded."""
    found = (name.rsplit("/", 1) for name in calls if "/" in name)
    return list(
        dict.fromkeys(module for module, call in found if call.rsplit(".", 1)[0] == WORD and module)
    )


def bind_pattern(
    key: str, selected: tuple[str, ...], exact: tuple[str, ...], calls: list[str]
) -> tuple[str, ...]:
    """The softmax call sites of the `selected` modules that are attention modules; a module
    named exactly that is none, or a selection with none, refused naming the model's
    attention modules (and modules matched by a glob that are none are left out)."""
    attention = attention_modules(calls)
    modules = set(attention)
    named = [m for m in selected if m in exact and m not in modules]
    if named or not any(m in modules for m in selected):
        bad = (named or list(selected))[0]
        shown = ", ".join(attention[:8]) + (", ..." if len(attention) > 8 else "")
        shown = shown or "none: the model has no eager attention module"
        raise HookrunError(
            f"{key}.at: pattern on {bad!r}, which is not an attention module (its forward "
            f"computes no attention probabilities); valid: {shown}"
        )
    keep = [m for m in selected if m in modules]
    return tuple(
        name
        for name in calls
        if "/" in name
        and name.rsplit("/", 1)[0] in keep
        and name.rsplit("/", 1)[1].rsplit(".", 1)[0] == WORD
    )
