"""`args.positions` of a hook on token data: which positions of a (N, T, ...) tensor it acts on.

`all` (every position, padding included: the mask is stored beside at /samples/mask), `last`
(each row's last real token; the position axis is dropped) or a list `[i, j, ...]` (a negative
index counts back from the end of the row's real tokens, so padding is skipped). A capture
stores (N, T, ...), (N, ...) or (N, P, ...); any other action acts at those positions only and
leaves the others as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hookrun.errors import HookrunError

__all__ = [
    "Positions",
    "parse_positions",
    "positions_shape",
    "check_positions",
    "check_lengths",
    "act_at",
]

_VALID = "all, last, or a list of token positions such as [0, -1] (negative: from the row's end)"


@dataclass(frozen=True)
class Positions:
    """`all`, `last`, or `items` (absolute when >= 0, from the end of the real tokens when < 0)."""

    kind: str  # all | last | list
    items: tuple[int, ...] = ()

    def describe(self) -> str:
        return self.kind if self.kind != "list" else "[" + ", ".join(map(str, self.items)) + "]"


def parse_positions(value: Any, key: str) -> Positions | None:
    """The hook's `args.positions` (None when not given), refused unless one of _VALID."""
    if value is None:
        return None
    if isinstance(value, str) and value in ("all", "last"):
        return Positions(value)
    if isinstance(value, str) or not hasattr(value, "__iter__") or not list(value):
        raise HookrunError(f"{key}: {value!r}; valid: {_VALID}")
    items = list(value)
    if any(isinstance(i, bool) or not isinstance(i, int) for i in items):
        raise HookrunError(f"{key}: {list(items)!r} holds a non-integer; valid: {_VALID}")
    if len(set(items)) != len(items):
        raise HookrunError(f"{key}: {list(items)!r} names a position twice; valid: {_VALID}")
    return Positions("list", tuple(items))


def positions_shape(positions: Positions, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The per-sample shape a capture at `positions` stores for a tensor of per-sample `shape`
    (T, ...)."""
    if positions.kind == "last":
        return shape[1:]
    if positions.kind == "list":
        return (len(positions.items), *shape[1:])
    return shape


def check_positions(positions: Positions, shape: tuple[int, ...], tokens: int, key: str) -> None:
    """Refuse, before any work, positions at a site whose tensor is not (T, ...) per sample
    (T = `tokens`, the rows' length)."""
    if not shape or shape[0] != tokens:
        raise HookrunError(
            f"{key}: {positions.describe()} at a tensor of per-sample shape {list(shape)}, whose "
            f"first axis is not the {tokens} token positions; valid: positions only at "
            "(tokens, ...) tensors such as block outputs"
        )


def check_lengths(positions: Positions, shortest: int, key: str) -> None:
    """Refuse listed positions past the real tokens of the shortest row (`shortest` tokens)."""
    for i in positions.items:
        if i >= shortest or -i > shortest:
            raise HookrunError(
                f"{key}: position {i} is past the shortest row, which has {shortest} real "
                f"tokens; valid: -{shortest}..{shortest - 1}"
            )


def _index(positions: Positions, mask: torch.Tensor) -> torch.Tensor:
    """Absolute positions (N, P) for each row of a batch, from its attention mask (N, T)."""
    lengths = mask.sum(dim=1).to(torch.int64)
    if positions.kind == "last":
        return (lengths - 1).unsqueeze(1)
    items = torch.tensor(positions.items, dtype=torch.int64, device=mask.device)
    return torch.where(items < 0, lengths.unsqueeze(1) + items, items.expand(len(lengths), -1))


def parse_heads(value: Any, key: str) -> tuple[int, ...] | None:
    """`args.heads` (a pattern site's heads an action changes): None or a list of ints."""
    if value is None:
        return None
    items = [value] if isinstance(value, int) else value
    if (
        isinstance(items, str)
        or not hasattr(items, "__iter__")
        or not list(items)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items)
    ):
        raise HookrunError(f"{key}: {value!r}; valid: a head index or a list of them (>= 0)")
    return tuple(dict.fromkeys(items))


def act_at(action: Any, tensor: torch.Tensor, ctx: Any, mask: torch.Tensor | None) -> Any:
    """`action` applied to `tensor` at its `positions` (all of it when none are set), and
    at a pattern site (N, heads, T, T) on its `heads` only (all when none are set). An action
    that changes nothing (a capture) sees only the positions' values, (N, P, ...) or (N, ...)
    for `last`; one that changes values sees the whole tensor and changes those positions."""
    heads: tuple[int, ...] | None = getattr(action, "heads", None)
    if heads is not None and action.changes:
        chosen = torch.zeros(tensor.shape[1], dtype=torch.bool, device=tensor.device)
        chosen[list(heads)] = True
        shape = (1, -1, *[1] * (tensor.dim() - 2))
        return torch.where(chosen.view(shape), action.apply(tensor, ctx), tensor)
    positions: Positions | None = getattr(action, "positions", None)
    if positions is None or positions.kind == "all" or mask is None:
        return action.apply(tensor, ctx)
    index = _index(positions, mask.to(tensor.device))
    rows = torch.arange(tensor.shape[0], device=tensor.device).unsqueeze(1)
    if not action.changes:
        picked = tensor[rows, index]  # (N, P, ...)
        action.apply(picked[:, 0] if positions.kind == "last" else picked, ctx)
        return tensor
    chosen = torch.zeros(tensor.shape[:2], dtype=torch.bool, device=tensor.device)
    chosen[rows, index] = True
    acted = action.apply(tensor, ctx)
    return torch.where(chosen.view(*chosen.shape, *[1] * (tensor.dim() - 2)), acted, tensor)
