"""The patched passes of the patching grid, computing only what a patch can change.

A cell (site kind, layer, position p) of a row replaces one module's output at p by the
clean value and reads the logit difference at the row's read position (its last token).
In a causal model nothing before p changes, so a patched pass resumes the corrupted pass
at p: the keys and values of the positions before p come from the corrupted pass's cache
(transformers' `past_key_values`) and only positions p … the batch's last read run, with
the logits taken at the read positions only. The cells grouped by position make one pass
per position (split at `rows_per_pass` rows: the cells of every site kind and layer of the
batch's rows at that position).

Cells whose outcome is known without a pass are not run, which is also what makes their
scores exactly 0 and 1:
- the clean value equals the corrupted one there, bit for bit (every position before the
  first token that differs): the patched run is the corrupted run, score 0;
- a module of the model's last block at a position other than the read: nothing after the
  last block mixes positions (final norm, unembedding), so the read is the corrupted one, 0;
- the last block's output at the read position, patched with the run's own clean values:
  the clean run's last hidden state there, so its logits, 1;
- positions past a row's read: no token there (the grid stores NaN).
A model whose cache is not plain per-layer keys and values (sliding windows, older
transformers) runs each patched pass from position 0 instead: the same cells, more work.

The `heads` site kind patches one attention head: its slice of the input of the attention's
output projection (the heads' outputs concatenated, before they are mixed), read and
replaced by forward pre-hooks; its cells are (layer, head, position).
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookrun.runtime.handles import ModuleHook, hooked

__all__ = ["Rows", "Pass", "Sites", "record", "patched_grids", "first_tensor", "HEADS"]

# The site kind whose values are a module's input (the output projection's), split by head.
HEADS = "heads"


def first_tensor(output: Any) -> torch.Tensor:
    """A module's output tensor (blocks and attention modules return tuples)."""
    return output[0] if isinstance(output, (tuple, list)) else output


@dataclass(frozen=True)
class Rows:
    """One batch of corrupted rows, right-padded: ids and mask (N, T), each row's read
    position (N,) and the answer and counterfactual answer tokens (N,) of its logit
    difference."""

    ids: torch.Tensor
    mask: torch.Tensor
    read: torch.Tensor
    right: torch.Tensor
    wrong: torch.Tensor

    def diff(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logit(answer) − logit(counterfactual answer) of the (len(rows), V) logits of
        `rows` (indices into the batch)."""
        picked = logits.float()
        right, wrong = self.right[rows][:, None], self.wrong[rows][:, None]
        return picked.gather(1, right)[:, 0] - picked.gather(1, wrong)[:, 0]


@dataclass
class Pass:
    """What one pass gave: each patched module's output (its input for `heads`), (N, T, D)
    per site kind and layer, the logit differences (N,), and its cache of keys and values
    (None: not kept)."""

    outputs: dict[str, list[torch.Tensor]]
    diff: torch.Tensor
    cache: Any = None


@dataclass(frozen=True)
class Sites:
    """What the grid patches: each site kind's module per layer patched, the index in that
    list of the model's last block (None when it is not patched), the positions patched,
    rows per patched pass, whether the clean values are the run's own (bit-exact, not read
    back from a file: the exact-1 cell holds), and the model's attention heads."""

    modules: dict[str, list[str]]
    last: dict[str, int | None]
    positions: list[int]
    rows_per_pass: int
    own_clean: bool = True
    heads: int = 1
    # The family's cache can be resumed (models/architectures.py: cache "kv"); else every
    # patched pass runs from position 0.
    resumes: bool = True

    def units(self, kind: str) -> int:
        """Cells per (layer, position) of a site kind: one per head for `heads`."""
        return self.heads if kind == HEADS else 1


def record(hf: nn.Module, modules: dict[str, list[str]], rows: Rows, keep_cache: bool) -> Pass:
    """One forward of the batch on the wrapped Hugging Face model, capturing every listed
    module's output (input for `heads`) at every position, the logit differences at the read
    positions and, with `keep_cache`, the cache of keys and values."""
    named = dict(hf.named_modules())
    outputs: dict[str, list[torch.Tensor]] = {kind: [] for kind in modules}
    hooks = []
    for kind, names in modules.items():
        into = outputs[kind]
        for name in names:
            if kind == HEADS:  # the output projection's input: the heads side by side
                keep = lambda m, a, into=into: into.append(first_tensor(a).detach())  # noqa: E731
                hooks.append(ModuleHook(named[name], keep, before=True))
            else:
                keep = lambda m, a, o, into=into: into.append(first_tensor(o).detach())  # noqa: E731
                hooks.append(ModuleHook(named[name], keep))
    with hooked(hooks):
        out = hf(
            input_ids=rows.ids, attention_mask=rows.mask, use_cache=keep_cache, return_dict=True
        )
    every = torch.arange(rows.ids.shape[0], device=rows.ids.device)
    cache = out.get(_cache_key(hf)) if keep_cache else None
    return Pass(outputs, rows.diff(out.logits[every, rows.read], every), cache)


def patched_grids(
    hf: nn.Module, sites: Sites, rows: Rows, clean: Pass, corrupted: Pass
) -> dict[str, torch.Tensor]:
    """Each site kind's (N, layers, positions) patched logit differences, (N, layers,
    heads, positions) for `heads` (positions past a row's read hold the corrupted one: the
    caller marks them)."""
    return _Grid(hf, sites, rows, clean, corrupted).run()


# A cell to run: (position, site kind, layer index, unit (head, or 0), row, position index).
_Cell = tuple[int, str, int, int, int, int]


class _Grid:
    def __init__(self, hf: nn.Module, sites: Sites, rows: Rows, clean: Pass, corrupted: Pass):
        self.hf, self.sites, self.rows = hf, sites, rows
        self.clean, self.corrupted = clean, corrupted
        self.named = dict(hf.named_modules())
        self.unembeds_reads = _accepts(type(hf), "logits_to_keep")
        self.cache_key = _cache_key(hf)
        self.end = int(rows.read.max()) + 1  # the batch's last read: nothing after it is run

    def run(self) -> dict[str, torch.Tensor]:
        out, cells = self._known()
        by_position: dict[int, list[_Cell]] = defaultdict(list)
        for cell in cells:
            by_position[cell[0]].append(cell)
        step = self.sites.rows_per_pass
        for position in sorted(by_position):
            group = by_position[position]
            for start in range(0, len(group), step):
                chunk = group[start : start + step]
                diffs = self._pass(position, chunk).tolist()
                for (_, kind, layer, unit, row, j), value in zip(chunk, diffs, strict=True):
                    out[kind][row, layer, unit, j] = value
        return {kind: grid if kind == HEADS else grid[:, :, 0] for kind, grid in out.items()}

    def _known(self) -> tuple[dict[str, torch.Tensor], list[_Cell]]:
        """The grids, (N, layers, units, positions), filled where the outcome is known
        without a pass (the corrupted difference, or the clean one at the exact-1 cell), and
        the cells left to run."""
        rows = self.rows
        where = torch.tensor(self.sites.positions, device=rows.ids.device)
        at_read = where[None, :] == rows.read[:, None]  # (N, P)
        inside = where[None, :] <= rows.read[:, None]
        out: dict[str, torch.Tensor] = {}
        cells: list[_Cell] = []
        for kind, names in self.sites.modules.items():
            units = self.sites.units(kind)
            grid = self.corrupted.diff[:, None, None, None].repeat(1, len(names), units, len(where))
            for layer in range(len(names)):
                was = self.corrupted.outputs[kind][layer][:, where]
                now = self.clean.outputs[kind][layer][:, where].to(was.dtype)
                same = (now == was).unflatten(2, (units, -1)).all(-1)  # (N, P, units)
                run = inside[:, :, None] & ~same
                if layer == self.sites.last.get(kind):
                    run &= at_read[:, :, None]
                    if kind == "resid" and self.sites.own_clean:
                        cells_here = grid[:, layer, 0]
                        clean = self.clean.diff[:, None].expand_as(cells_here)
                        cells_here[at_read] = clean[at_read]
                        continue
                for row, j, unit in run.nonzero().tolist():
                    cells.append((self.sites.positions[j], kind, layer, unit, row, j))
            out[kind] = grid
        return out, cells

    def _pass(self, position: int, chunk: list[_Cell]) -> torch.Tensor:
        """The patched logit differences of `chunk` (cells at one position), one forward of
        the corrupted rows resumed at `position`."""
        rows = self.rows
        device = rows.ids.device
        which = torch.tensor([c[4] for c in chunk], device=device)
        cache = _prefix(self.corrupted.cache, which, position) if self.sites.resumes else None
        start = position if cache is not None else 0
        read = rows.read[which] - start
        extra: dict[str, Any] = {self.cache_key: cache}
        if self.unembeds_reads:
            keep = torch.unique(read)  # sorted: searchsorted finds each read's column
            extra["logits_to_keep"] = keep
            read = torch.searchsorted(keep, read)
        by_site: dict[tuple[str, int], list[int]] = defaultdict(list)
        for i, (_, kind, layer, _, _, _) in enumerate(chunk):
            by_site[(kind, layer)].append(i)
        hooks = []
        for (kind, layer), mine in by_site.items():
            at = torch.tensor(mine, device=device)
            values = self.clean.outputs[kind][layer][which[at], position]
            module = self.named[self.sites.modules[kind][layer]]
            if kind == HEADS:
                units = torch.tensor([chunk[i][3] for i in mine], device=device)
                heads = (units, self.sites.heads)
                replace = _replacing_heads(at, position - start, values, heads)
                hooks.append(ModuleHook(module, replace, before=True))
            else:
                hooks.append(ModuleHook(module, _replacing(at, position - start, values)))
        with hooked(hooks):
            out = self.hf(
                input_ids=rows.ids[which, start : self.end],
                attention_mask=rows.mask[which, : self.end],
                use_cache=cache is not None,
                return_dict=True,
                **extra,
            )
        every = torch.arange(len(chunk), device=device)
        return rows.diff(out.logits[every, read], which)


def _cache_key(hf: nn.Module) -> str:
    """The name a model's forward and output give the cache of keys and values:
    `past_key_values`, or `cache` from transformers 5.24 on."""
    return "cache" if _accepts(type(hf), "cache") else "past_key_values"


@functools.lru_cache(maxsize=64)
def _accepts(model_class: type, name: str) -> bool:
    """Whether a model class's forward takes the keyword `name` (read once per class, not
    once per batch)."""
    return name in inspect.signature(model_class.forward).parameters


def _replacing(rows: torch.Tensor, position: int, values: torch.Tensor) -> Callable:
    """A forward hook that puts `values` at (rows, position) of the module's output."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        tensor = first_tensor(output).clone()
        tensor[rows, position] = values.to(tensor.dtype)
        if isinstance(output, (tuple, list)):
            return type(output)((tensor, *output[1:]))
        return tensor

    return hook


def _replacing_heads(
    rows: torch.Tensor, position: int, values: torch.Tensor, heads: tuple[torch.Tensor, int]
) -> Callable:
    """A forward pre-hook that puts, in each of `rows`, its head's slice of `values` at
    `position` of the module's input; `heads` = (each row's head, the head count)."""
    which, count = heads

    def hook(module: nn.Module, args: Any) -> Any:
        tensor = first_tensor(args).clone()
        split = tensor.unflatten(-1, (count, -1))  # a view: (rows, T, heads, head width)
        split[rows, position, which] = values.unflatten(-1, (count, -1))[
            torch.arange(len(rows), device=rows.device), which
        ].to(tensor.dtype)
        return (tensor, *args[1:])

    return hook


def _prefix(cache: Any, which: torch.Tensor, length: int) -> Any:
    """A cache of the first `length` positions of the rows `which` of `cache`, or None where
    there is nothing to resume from (length 0) or the cache is not plain per-layer keys and
    values (then the pass runs from position 0)."""
    layers = getattr(cache, "layers", None)
    if length == 0 or not layers:
        return None
    plain = type(layers[0]).__name__ == "DynamicLayer"
    same = all(type(layer) is type(layers[0]) for layer in layers)
    if not plain or not same or not all(getattr(x, "keys", None) is not None for x in layers):
        return None
    out = copy.copy(cache)
    out.layers = []
    for layer in layers:
        mine = copy.copy(layer)
        mine.keys = layer.keys[which, :, :length]
        mine.values = layer.values[which, :, :length]
        out.layers.append(mine)
    return out
