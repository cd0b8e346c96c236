"""Activation patching (experiment=lm_patching): for each layer and each position, the
corrupted prompt run with that site's activation replaced by the clean prompt's, and how
much of the clean logit difference comes back (Meng et al. 2022; Wang et al. 2022).

The clean run is the row's prompt, the corrupted run its counterfactual (dataset=prompts,
of the prompt's token length). A run's logit difference is logit(answer) −
logit(counterfactual_answer) at the read position (the prompt's last token), and a cell's
score is (patched − corrupted) / (clean − corrupted): 1 where the patch brings the clean
answer back whole, 0 where it changes nothing (NaN where clean = corrupted, and at positions
past a row's last real token).

Per batch: one clean forward capturing every patched module's output, one corrupted
forward, then the layers × positions patched runs batched: the corrupted batch stacked once
per cell, `rows_per_pass` rows per forward (chunks of whole copies), with forward hooks that
replace, in copy (l, p), layer l's output at position p by the clean value. The passes run
on the bare model: the run's own hooks stand aside (engine/stream.py), as for the evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
import torch
from torch import nn

from hookrun.errors import HookrunError
from hookrun.evaluate.registry import Stored
from hookrun.io import layout
from hookrun.memory import format_bytes
from hookrun.models.language import every_position
from hookrun.patching.clean import StoredClean, open_clean
from hookrun.patching.config import PatchingConfig, chosen_layers

__all__ = ["PatchingGrid", "plan_patching", "ARCHITECTURES"]

# Module name patterns per site kind ({} = the layer), by the families' `model_type`.
_LLAMA = {
    "resid": "model.layers.{}",
    "attn": "model.layers.{}.self_attn",
    "mlp": "model.layers.{}.mlp",
}
ARCHITECTURES: dict[str, dict[str, str]] = {
    "gpt2": {
        "resid": "transformer.h.{}",
        "attn": "transformer.h.{}.attn",
        "mlp": "transformer.h.{}.mlp",
    },
    "gpt_neox": {
        "resid": "gpt_neox.layers.{}",
        "attn": "gpt_neox.layers.{}.attention",
        "mlp": "gpt_neox.layers.{}.mlp",
    },
    **{family: _LLAMA for family in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")},
}
_CELL = "per row: {layers} layers × {positions} positions"


def _first(output: Any) -> torch.Tensor:
    """A module's output tensor (blocks and attention modules return tuples)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _replacing(rows: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> Callable:
    """A forward hook that puts `values` at (rows, positions) of the module's output."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        tensor = _first(output).clone()
        tensor[rows, positions] = values.to(tensor.dtype)
        if isinstance(output, (tuple, list)):
            return type(output)((tensor, *output[1:]))
        return tensor

    return hook


@dataclass
class PatchingGrid:
    """The patching a run does per batch, planned and checked (plan_patching)."""

    config: PatchingConfig
    modules: dict[str, list[str]]  # site kind → its module per layer
    positions: list[int]  # the positions patched (P)
    counterfactual: torch.Tensor  # (rows, T) int64: each row's counterfactual ids, padded
    wrong: torch.Tensor  # (rows,) int64: each row's counterfactual answer
    rows_per_pass: int  # rows of one patched forward pass (whole copies of the batch)
    row_bytes: int  # the estimate rows_per_pass is made from (per row of a pass)
    clean: StoredClean | None = None  # patching.clean: the clean run read from a file

    @property
    def layers(self) -> int:
        return len(next(iter(self.modules.values())))

    def stored(self) -> dict[str, Stored]:
        """Every dataset patching writes: per-sample shape and attributes."""
        grid = (self.layers, len(self.positions))
        out = {
            layout.patching_key(layout.PATCHING_CLEAN): Stored((), {}),
            layout.patching_key(layout.PATCHING_CORRUPTED): Stored((), {}),
        }
        for kind, names in self.modules.items():
            attrs = {
                "layers": np.array(names, dtype=h5py.string_dtype()),
                "positions": self.positions,
            }
            out[layout.patching_key(kind)] = Stored(grid, attrs)
            out[layout.patching_key(kind, layout.LOGIT_DIFF_SUFFIX)] = Stored(grid, attrs)
        return out

    def attrs(self) -> dict[str, dict[str, Any]]:
        """The /patching group's attributes (what clean and corrupted are)."""
        said = {"clean": "prompt", "corrupted": "counterfactual"}
        if self.clean is not None:
            said |= {"clean_file": str(self.clean.path), "clean_sha256": self.clean.sha256}
        return {layout.PATCHING: said}

    def describe(self, itemsize: int) -> str:
        """The dry-run lines: the grid, how the patched passes are chunked, and the datasets
        with their bytes per sample (in the estimated file size above)."""
        cells = self.layers * len(self.positions)
        sized = (
            "patching.batch_size"
            if self.config.batch_size
            else (
                f"patching.memory_mib={self.config.memory_mib} MiB / {format_bytes(self.row_bytes)}"
                " per row (4 B × tokens × (vocab + 12 × width + heads × tokens))"
            )
        )
        source = f" (read from {self.clean.path})" if self.clean else ""
        grid = _CELL.format(layers=self.layers, positions=len(self.positions))
        lines = [
            f"Patching ({', '.join(self.modules)}): clean = the prompt{source}, corrupted = "
            f"the counterfactual; {grid} = {cells} cells per site kind, batched "
            f"{self.rows_per_pass} rows per patched forward ({sized})"
        ]
        for key, stored in self.stored().items():
            size = format_bytes(math.prod(stored.shape) * itemsize)
            lines.append(f"    {str(list(stored.shape)):<20} {size:>11}/sample  /{key}")
        return "\n".join(lines)

    def batch(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, index: torch.Tensor
    ) -> dict[str, np.ndarray]:
        """The batch's records: `inputs` (N, 3, T) the clean rows on the device, `labels`
        their answers, `index` their dataset indices."""
        device = inputs.device
        corrupt = inputs.clone()
        corrupt[:, 0] = self.counterfactual[index.cpu()].to(device)
        answers = (labels.to(device), self.wrong[index.cpu()].to(device))
        with torch.inference_mode(), every_position(model):
            if self.clean is not None:
                seen, logits = self.clean.read(index, device)
            else:
                seen, logits = self._clean(model, inputs)
            clean = _logit_diff(logits, answers)
            corrupted = _logit_diff(model(corrupt), answers)
            out = {
                layout.patching_key(layout.PATCHING_CLEAN): clean,
                layout.patching_key(layout.PATCHING_CORRUPTED): corrupted,
            }
            past = self._past_rows(inputs[:, 1].sum(1))
            for kind, names in self.modules.items():
                patched = self._grid(model, corrupt, answers, (names, seen[kind]))
                patched[past] = torch.nan
                gap = clean - corrupted
                score = (patched - corrupted[:, None, None]) / gap[:, None, None]
                score[(gap == 0)[:, None, None].expand_as(score)] = torch.nan
                out[layout.patching_key(kind)] = score
                out[layout.patching_key(kind, layout.LOGIT_DIFF_SUFFIX)] = patched
        return {k: v.float().cpu().numpy() for k, v in out.items()}

    def _past_rows(self, lengths: torch.Tensor) -> torch.Tensor:
        """(N, L, P) bool: the cells at positions past each row's last real token."""
        positions = torch.tensor(self.positions, device=lengths.device)
        past = positions[None, :] >= lengths[:, None]
        return past[:, None, :].expand(-1, self.layers, -1)

    def _clean(self, model: nn.Module, inputs: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """Every patched module's output (N, T, D) on the clean rows, per site kind and
        layer, and the clean logit differences, from one forward pass."""
        seen: dict[str, list[torch.Tensor]] = {kind: [] for kind in self.modules}
        named = dict(model.named_modules())
        handles = [
            named[name].register_forward_hook(
                lambda m, a, o, into=seen[kind]: into.append(_first(o).detach())
            )
            for kind, names in self.modules.items()
            for name in names
        ]
        try:
            logits = model(inputs)
        finally:
            for handle in handles:
                handle.remove()
        return seen, logits

    def _grid(
        self, model: nn.Module, corrupt: torch.Tensor, answers: tuple, site: tuple
    ) -> torch.Tensor:
        """(N, L, P) patched logit differences of one site kind; `site` = (module names per
        layer, their clean outputs per layer)."""
        names, clean = site
        n, count = corrupt.shape[0], len(self.positions)
        cells = [(layer, p) for layer in range(len(names)) for p in range(count)]
        copies = max(1, self.rows_per_pass // n)
        named = dict(model.named_modules())
        right, wrong = (a.repeat(copies) for a in answers)
        rows = torch.arange(n, device=corrupt.device)
        out = torch.empty(len(cells), n, device=corrupt.device)
        for start in range(0, len(cells), copies):
            chunk = cells[start : start + copies]
            handles = []
            for layer in sorted({c[0] for c in chunk}):
                mine = [i for i, c in enumerate(chunk) if c[0] == layer]
                where = torch.tensor([self.positions[chunk[i][1]] for i in mine]).to(rows)
                at = (torch.tensor(mine).to(rows)[:, None] * n + rows).flatten()
                column = where[:, None].expand(-1, n).flatten()
                values = clean[layer][rows.repeat(len(mine)), column]
                hook = _replacing(at, column, values)
                handles.append(named[names[layer]].register_forward_hook(hook))
            try:
                logits = model(corrupt.repeat(len(chunk), 1, 1))
            finally:
                for handle in handles:
                    handle.remove()
            k = len(chunk) * n
            diff = _logit_diff(logits, (right[:k], wrong[:k]))
            out[start : start + len(chunk)] = diff.view(len(chunk), n)
        return out.view(len(names), count, n).permute(2, 0, 1).contiguous()


def _logit_diff(logits: torch.Tensor, answers: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """logit(answer) − logit(counterfactual answer) per row of (rows, V) logits."""
    right, wrong = answers
    picked = logits.float()
    return picked.gather(1, right[:, None])[:, 0] - picked.gather(1, wrong[:, None])[:, 0]


def _site_modules(config: PatchingConfig, model: nn.Module) -> dict[str, list[str]]:
    """Each patched site kind's module per layer, for the model's architecture."""
    model_type = str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))
    patterns = ARCHITECTURES.get(model_type)
    if patterns is None:
        raise HookrunError(
            f"patching.sites: {', '.join(config.sites)} on a {model_type} model, whose module "
            f"names patching does not know; valid: a model of {', '.join(ARCHITECTURES)}"
        )
    named = dict(model.named_modules())
    out: dict[str, list[str]] = {}
    for kind in config.sites:
        names: list[str] = []
        while patterns[kind].format(len(names)) in named:
            names.append(patterns[kind].format(len(names)))
        if not names:
            raise HookrunError(
                f"patching.sites: {kind}: the {model_type} model has no module "
                f"{patterns[kind].format(0)}; valid: a {model_type} model as transformers builds it"
            )
        out[kind] = [names[i] for i in chosen_layers(config.layer, len(names))]
    return out


def _counterfactuals(tokens: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's counterfactual ids padded like its prompt (rows, T), and its counterfactual
    answer; refused naming the row: no counterfactual, no answers, another token length."""
    ids = getattr(tokens, "counterfactual_ids", None)
    valid = "valid: rows {prompt, answer, counterfactual, counterfactual_answer} (dataset=prompts)"
    if ids is None:
        raise HookrunError(f"patching: the dataset has no counterfactual prompts; {valid}")
    out = tokens.ids[:rows].clone()
    wrong = torch.zeros(rows, dtype=torch.int64)
    for r in range(rows):
        name, line = tokens.sources[r]
        length, cf = int(tokens.lengths[r]), ids[r]
        missing = [
            k
            for k, v in (
                ("answer", tokens.has_labels or None),
                ("counterfactual", cf),
                ("counterfactual_answer", tokens.counterfactual_answer[r]),
            )
            if v is None
        ]
        if missing:
            raise HookrunError(f"dataset.path: {name}:{line} has no '{missing[0]}'; {valid}")
        if len(cf) != length:
            raise HookrunError(
                f"dataset.path: {name}:{line}: the counterfactual has {len(cf)} tokens, the "
                f"prompt {length}; valid: a counterfactual of the prompt's token length"
            )
        out[r, :length] = torch.tensor(cf)
        wrong[r] = int(tokens.counterfactual_answer[r])
    return out, wrong


def plan_patching(
    config: PatchingConfig | None, model: nn.Module, tokens: Any, rows: int
) -> PatchingGrid | None:
    """The run's patching (None without a `patching:` node), checked before any work:
    `tokens` the run's TokenRows (None for other data), `rows` the rows of the run."""
    if config is None:
        return None
    if tokens is None:
        raise HookrunError(
            "patching: needs token rows with counterfactuals; valid: dataset=prompts with "
            "{prompt, answer, counterfactual, counterfactual_answer} rows"
        )
    modules = _site_modules(config, model)
    counterfactual, wrong = _counterfactuals(tokens, rows)
    length = int(tokens.ids.shape[1])
    positions = list(range(length)) if config.positions == "all" else list(config.positions)
    shortest = int(tokens.lengths[:rows].argmin())
    if config.positions != "all" and max(positions) >= int(tokens.lengths[shortest]):
        name, line = tokens.sources[shortest]
        raise HookrunError(
            f"patching.positions: {max(positions)} is past the row at {name}:{line} "
            f"({int(tokens.lengths[shortest])} tokens); valid: positions 0 to "
            f"{int(tokens.lengths[shortest]) - 1}, or all"
        )
    cfg = model.config
    width, heads = int(cfg.hidden_size), int(getattr(cfg, "num_attention_heads", 1))
    row_bytes = 4 * length * (int(cfg.vocab_size) + 12 * width + heads * length)
    rows_per_pass = config.batch_size or max(1, config.memory_mib * 2**20 // row_bytes)
    clean = open_clean(config.clean, modules, tokens, rows) if config.clean else None
    return PatchingGrid(
        config, modules, positions, counterfactual, wrong, rows_per_pass, row_bytes, clean
    )


def stored_shapes(grid: PatchingGrid | None) -> Mapping[str, tuple[int, ...]]:
    """Each stored dataset's per-sample shape (nothing without patching)."""
    return {k: v.shape for k, v in grid.stored().items()} if grid else {}
