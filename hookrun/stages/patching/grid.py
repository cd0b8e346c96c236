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
forward capturing them too and keeping its keys and values, then the patched runs: one
pass per position, each the cells of every site kind and layer at that position stacked
(`rows_per_pass` rows per forward), resumed from the corrupted pass's cache at that
position, with forward hooks that put the clean value there (resume.py: which cells need no
pass). The passes run on the bare model: the run's own hooks stand aside
(pipeline/stream.py), as for the evaluation.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import h5py
import numpy as np
import torch
from torch import nn

from hookrun.data.batch import Batch
from hookrun.errors import HookrunError
from hookrun.memory import format_bytes
from hookrun.models.adapter import adapt
from hookrun.models.architectures import ARCHITECTURE_KEYS, ARCHITECTURES, architecture_of
from hookrun.stage import Stored
from hookrun.stages.patching.attribution import attribution_grids
from hookrun.stages.patching.clean import StoredClean, open_clean
from hookrun.stages.patching.config import APPROXIMATIONS, PatchingConfig, chosen_layers
from hookrun.stages.patching.keys import (
    CELLS,
    CLEAN_TOLERANCE,
    ERROR_SUFFIX,
    LOGIT_DIFF_SUFFIX,
    PATCHING,
    PATCHING_CLEAN,
    PATCHING_CORRUPTED,
    PEARSON,
    SPEARMAN,
    flat_rows,
    patching_key,
)
from hookrun.stages.patching.resume import HEADS, Pass, Rows, Sites, patched_grids, record

__all__ = ["PatchingGrid", "plan_patching", "counterfactuals"]

log = logging.getLogger("hookrun")

_CELL = "per row: {layers} layers × {positions} positions"


@dataclass
class PatchingGrid:
    """The patching a run does per batch, planned and checked (plan_patching)."""

    config: PatchingConfig
    modules: dict[str, list[str]]  # site kind → its module per layer
    last: dict[str, int | None]  # site kind → the model's last block's index in modules
    positions: list[int]  # the positions patched (P)
    counterfactual: torch.Tensor  # (rows, T) int64: each row's counterfactual ids, padded
    wrong: torch.Tensor  # (rows,) int64: each row's counterfactual answer
    rows_per_pass: int  # rows of one patched forward pass (cells at one position)
    row_bytes: int  # the estimate rows_per_pass is made from (per row of a pass)
    clean: StoredClean | None = None  # patching.clean: the clean run read from a file
    heads: int = 1  # the model's attention heads (a `heads` grid has a row per head)
    resumes: bool = True  # its cache can be resumed (models/architectures.py)

    @property
    def layers(self) -> int:
        return len(next(iter(self.modules.values())))

    def stored(self) -> dict[str, Stored]:
        """Every dataset patching writes: per-sample shape and attributes."""
        out = {
            patching_key(PATCHING_CLEAN): Stored((), {}),
            patching_key(PATCHING_CORRUPTED): Stored((), {}),
        }
        methods = self.config.methods
        for kind, names in self.modules.items():
            attrs = {
                "layers": np.array(names, dtype=h5py.string_dtype()),
                "positions": self.positions,
            }
            grid = (self.layers, len(self.positions))
            if kind == HEADS:
                grid, attrs["heads"] = (self.layers, self.heads, len(self.positions)), self.heads
            if "exact" in methods:
                out[patching_key(kind)] = Stored(grid, attrs)
                out[patching_key(kind, LOGIT_DIFF_SUFFIX)] = Stored(grid, attrs)
            for method in (m for m in methods if m in APPROXIMATIONS):
                said = attrs | ({"ig_steps": self.config.ig_steps} if method == "atp_ig" else {})
                # Its agreement with exact, known when the file is complete: made now (SWMR
                # lets a later write change an attribute, not add one).
                agrees = {PEARSON: np.nan, SPEARMAN: np.nan, CELLS: 0} if "exact" in methods else {}
                out[patching_key(kind, f"_{method}")] = Stored(grid, said | agrees)
                if "exact" in methods:
                    out[patching_key(kind, f"_{method}{ERROR_SUFFIX}")] = Stored(grid, said)
        return out

    def attrs(self) -> dict[str, dict[str, Any]]:
        """The /patching group's attributes (what clean and corrupted are)."""
        said = {"clean": "prompt", "corrupted": "counterfactual"}
        if self.clean is not None:
            said |= {
                "clean_file": str(self.clean.path),
                "clean_sha256": self.clean.sha256,
                CLEAN_TOLERANCE: self.clean.tolerance,
            }
        return {PATCHING: said}

    def describe(self, itemsize: int) -> str:
        """The dry-run lines: the grid, how the patched passes are chunked, and the datasets
        with their bytes per sample (in the estimated file size above)."""
        cells = {
            kind: self.layers * len(self.positions) * (self.heads if kind == HEADS else 1)
            for kind in self.modules
        }
        sized = (
            "patching.batch_size"
            if self.config.batch_size
            else (
                f"patching.memory_mib={self.config.memory_mib} MiB / {format_bytes(self.row_bytes)}"
                " per row (4 B × (tokens × (12 × width + heads × tokens + 2 × layers × key "
                "and value width) + vocab))"
            )
        )
        source = f" (read from {self.clean.path})" if self.clean else ""
        grid = _CELL.format(layers=self.layers, positions=len(self.positions))
        per_head = f" (× {self.heads} heads for heads)" if HEADS in self.modules else ""
        lines = [
            f"Patching ({', '.join(self.modules)}): clean = the prompt{source}, corrupted = "
            f"the counterfactual; {grid}{per_head} = "
            f"{', '.join(f'{n} {kind}' for kind, n in cells.items())} cells, batched "
            f"{self.rows_per_pass} rows per patched forward ({sized})"
        ]
        approximations = [m for m in self.config.methods if m in APPROXIMATIONS]
        if approximations:
            lines.append(
                f"Attribution patching ({', '.join(approximations)}): per batch of batch_size "
                "rows, a forward and a backward pass with gradients, each patched site's "
                "output and gradient kept at every position (not bounded by "
                "patching.memory_mib: lower batch_size if it does not fit)"
            )
        if "exact" not in self.config.methods:
            lines[0] = lines[0].split("; ", 1)[0] + "; no exact grid (patching.method)"
        for key, stored in self.stored().items():
            size = format_bytes(math.prod(stored.shape) * itemsize)
            lines.append(f"    {str(list(stored.shape)):<20} {size:>11}/sample  /{key}")
        return "\n".join(lines)

    def batch(self, model: nn.Module, batch: Batch, own: np.ndarray) -> dict[str, np.ndarray]:
        """The batch's records: `batch` the clean rows on the device, labelled with their
        answers; `own` the run's own logits (N, V) at the read position, as stored."""
        index, device = batch.index, batch.inputs.device
        hf = adapt(model).language.hf  # its cache and logits are used (plan_patching)
        rows = Rows(
            self.counterfactual[index.cpu()].to(device),
            batch.mask,
            batch.read,
            batch.labels.to(device),
            self.wrong[index.cpu()].to(device),
        )
        with torch.inference_mode():
            if self.clean is not None:
                seen, logits = self.clean.read(index, device)
                every = torch.arange(len(index), device=device)
                clean = Pass(seen, rows.diff(logits, every))
            else:
                clean = record(hf, self.modules, replace(rows, ids=batch.tokens), False)
            exact = "exact" in self.config.methods
            # Without exact, the approximations' first gradient run is the corrupted pass.
            corrupted = record(hf, self.modules, rows, True) if exact else None
            sites = Sites(
                modules=self.modules,
                last=self.last,
                positions=self.positions,
                rows_per_pass=self.rows_per_pass,
                own_clean=self.clean is None,
                heads=self.heads,
                resumes=self.resumes,
            )
            grids = patched_grids(hf, sites, rows, clean, corrupted) if exact else {}
        found, corrupted = self._approximations(hf, sites, rows, (batch.tokens, clean), corrupted)
        grids |= found
        tolerance = self.clean.tolerance if self.clean is not None else 0.0
        diffs = clean.diff.float().cpu().numpy(), corrupted.diff.float().cpu().numpy()
        flat = flat_rows(*diffs, own, tolerance)
        unscorable = index.cpu()[torch.from_numpy(flat)].tolist()
        if unscorable:  # known only now: the file's `unscorable` attribute and the summary too
            log.warning(
                "patching: clean − corrupted logit difference is 0 for dataset rows %s: "
                "every cell of their grid is NaN (the model does not tell the prompt from its "
                "counterfactual there)",
                ", ".join(map(str, unscorable)),
            )
        flat_on_device = torch.from_numpy(flat).to(device)
        return self._records(grids, (clean.diff, corrupted.diff), flat_on_device, batch.mask.sum(1))

    def _approximations(
        self,
        hf: nn.Module,
        sites: Sites,
        rows: Rows,
        clean: tuple[torch.Tensor, Pass],
        corrupted: Pass | None,
    ) -> tuple[dict[str, torch.Tensor], Pass]:
        """Each approximate method's estimated patched logit differences, keyed
        `<kind>_<method>` like the exact grids' kinds, at the patched positions."""
        methods = [m for m in self.config.methods if m in APPROXIMATIONS]
        if not methods:
            assert corrupted is not None  # exact ran
            return {}, corrupted
        # One set of gradient runs serves both: atp is the first of atp_ig's runs.
        steps = self.config.ig_steps if "atp_ig" in methods else 1
        found, corrupted = attribution_grids(hf, sites, rows, clean, corrupted, steps)
        at = torch.tensor(self.positions, device=rows.ids.device)
        return {
            f"{kind}_{method}": corrupted.diff.view(-1, *[1] * (cells.dim() - 1)) + cells[..., at]
            for method in methods
            for kind, cells in found[method].items()
        }, corrupted

    def _records(
        self, grids: dict, diffs: tuple, flat: torch.Tensor, lengths: torch.Tensor
    ) -> dict[str, np.ndarray]:
        """The stored arrays: the raw logit differences and the scores, NaN past each row's
        tokens and in the `flat` rows (clean = corrupted); an approximation's scores and,
        beside the exact grid, their error."""
        clean, corrupted = diffs
        out = {
            patching_key(PATCHING_CLEAN): clean,
            patching_key(PATCHING_CORRUPTED): corrupted,
        }
        positions = torch.tensor(self.positions, device=lengths.device)
        past_row = positions[None, :] >= lengths[:, None]  # (N, P): no token there
        gap = clean - corrupted
        scores = {}
        for kind, patched in grids.items():
            patched = patched.clone()  # out of inference mode
            per_row = (-1,) + (1,) * (patched.dim() - 1)  # (N, 1, …) against (N, L, [H,] P)
            patched[past_row.view(len(lengths), *per_row[2:], -1).expand_as(patched)] = torch.nan
            score = (patched - corrupted.view(per_row)) / gap.view(per_row)
            score[flat.view(per_row).expand_as(score)] = torch.nan
            scores[kind] = score
            out[patching_key(kind)] = score  # <site kind>, or <site kind>_<approximation>
            if kind in self.modules:
                out[patching_key(kind, LOGIT_DIFF_SUFFIX)] = patched
        for kind in self.modules:
            for method in (m for m in self.config.methods if m in APPROXIMATIONS):
                if kind in scores:
                    error = scores[f"{kind}_{method}"] - scores[kind]
                    out[patching_key(kind, f"_{method}{ERROR_SUFFIX}")] = error
        return {k: v.float().cpu().numpy() for k, v in out.items()}


def _site_modules(config: PatchingConfig, model: nn.Module) -> tuple[dict, dict]:
    """Each patched site kind's module per layer, from the model's family in the
    architecture table (models/architectures.py), and the index in that list of the model's
    last block (None when it is not patched)."""
    entry = architecture_of(model)
    hf = adapt(model).transformers_model() or model
    model_type = str(getattr(getattr(hf, "config", None), "model_type", type(hf).__name__))
    known = [t for a in ARCHITECTURES if a.causal for t in a.model_types]
    if entry is None or not entry.causal:
        why = (
            "which is not a causal language model" if entry else "whose parts hookrun does not know"
        )
        raise HookrunError(
            f"patching.sites: {', '.join(config.sites)} on a {model_type} model, {why}; valid: "
            f"a model of {', '.join(known)} (a new family is an entry of models/architectures.py: "
            f"{', '.join(ARCHITECTURE_KEYS)})"
        )
    named = dict(model.named_modules())
    out: dict[str, list[str]] = {}
    last: dict[str, int | None] = {}
    for kind in config.sites:
        pattern = entry.site(kind)
        names: list[str] = []
        while pattern.format(len(names)) in named:
            names.append(pattern.format(len(names)))
        if not names:
            raise HookrunError(
                f"patching.sites: {kind}: the {model_type} model has no module "
                f"{pattern.format(0)}; valid: a {model_type} model as transformers builds it"
            )
        chosen = chosen_layers(config.layer, len(names))
        out[kind] = [names[i] for i in chosen]
        last[kind] = chosen.index(len(names) - 1) if len(names) - 1 in chosen else None
    return out, last


def counterfactuals(tokens: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's counterfactual ids padded like its prompt (rows, T), and its counterfactual
    answer; refused naming the row: no counterfactual, no answers, another token length."""
    ids = getattr(tokens, "counterfactual_ids", None)
    valid = "valid: rows {prompt, answer, counterfactual, counterfactual_answer} (dataset=prompts)"
    if ids is None:
        raise HookrunError(f"patching: the dataset has no counterfactual prompts; {valid}")
    out = tokens.ids[:rows].clone()
    for r in range(rows):
        name, line = tokens.sources[r]
        length, cf = int(tokens.lengths[r]), ids[r]
        missing = tokens.missing(r, ("answer", "counterfactual", "counterfactual_answer"))
        if missing:
            raise HookrunError(f"dataset.path: {name}:{line} has no '{missing}'; {valid}")
        if len(cf) != length:
            raise HookrunError(
                f"dataset.path: {name}:{line}: the counterfactual has {len(cf)} tokens, the "
                f"prompt {length}; valid: a counterfactual of the prompt's token length"
            )
        _refuse_unscorable(tokens, r, cf)
        out[r, :length] = torch.tensor(cf)
    return out, tokens.counterfactual_answers()[:rows]


def _refuse_unscorable(tokens: Any, row: int, counterfactual: list[int]) -> None:
    """A row whose clean − corrupted logit difference is 0 whatever the model (the same
    answer token twice, or a counterfactual that is the prompt itself) divides every cell by
    zero: refused, naming it, before any work."""
    name, line = tokens.sources[row]
    answer, wrong = int(tokens.labels[row]), int(tokens.counterfactual_answer[row])
    if answer == wrong:
        raise HookrunError(
            f"dataset.path: {name}:{line}: the answer and the counterfactual_answer are one "
            f"token (id {answer}), so clean − corrupted is 0 and every cell of its grid would "
            "divide by it; valid: a counterfactual_answer whose first token differs"
        )
    if list(counterfactual) == tokens.ids[row, : len(counterfactual)].tolist():
        raise HookrunError(
            f"dataset.path: {name}:{line}: the counterfactual is the prompt itself (the same "
            f"{len(counterfactual)} tokens), so the clean and corrupted runs are one run; "
            "valid: a counterfactual that differs from the prompt"
        )


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
    modules, last = _site_modules(config, model)
    counterfactual, wrong = counterfactuals(tokens, rows)
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
    width, heads = int(cfg.hidden_size), _heads(cfg, config)
    layers = int(getattr(cfg, "num_hidden_layers", 1))
    kv_width = width // heads * int(getattr(cfg, "num_key_value_heads", None) or heads)
    # A patched pass's row: its activations at up to `length` positions, its copy of the
    # corrupted keys and values, and the logits at its read position only.
    row_bytes = 4 * (
        length * (12 * width + heads * length + 2 * layers * kv_width) + cfg.vocab_size
    )
    rows_per_pass = config.batch_size or max(1, config.memory_mib * 2**20 // row_bytes)
    clean = open_clean(config.clean, modules, tokens, rows) if config.clean else None
    return PatchingGrid(
        config=config,
        modules=modules,
        last=last,
        positions=positions,
        counterfactual=counterfactual,
        wrong=wrong,
        rows_per_pass=rows_per_pass,
        row_bytes=row_bytes,
        clean=clean,
        heads=heads,
        resumes=architecture_of(model).cache == "kv",
    )


def _heads(cfg: Any, config: PatchingConfig) -> int:
    """The model's attention heads (a `heads` grid has a row per head); refused for
    patching.sites: heads where the config does not say."""
    heads = getattr(cfg, "num_attention_heads", None)
    if heads is None and "heads" in config.sites:
        raise HookrunError(
            "patching.sites: heads: the model's config has no num_attention_heads; valid: "
            "resid, attn, mlp"
        )
    return int(heads or 1)


def stored_shapes(grid: PatchingGrid | None) -> Mapping[str, tuple[int, ...]]:
    """Each stored dataset's per-sample shape (nothing without patching)."""
    return {k: v.shape for k, v in grid.stored().items()} if grid else {}
