"""Vectors measured from prompt sets (`args.vector: {prompts: FILE, positions}`,
runtime/vectors.py), before any work: the run's model reads each file's rows — tokenized as
dataset=prompts reads them, with the run's tokenizer — with a capture at every site of the
hooks that name it, and each site's mean is taken over the rows' last real tokens (`last`)
or over every real token (`all`). One pass per file serves every site and both positions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookrun.data.corpus import json_rows
from hookrun.data.prompts import PromptsDatasetConfig, TooLong, prompt_rows, prompt_texts
from hookrun.data.tokens import TokenRows
from hookrun.errors import HookrunError
from hookrun.models.adapter import adapt
from hookrun.runtime.actions import build_action
from hookrun.runtime.hooks import Recorder, attach, run_mode
from hookrun.runtime.plan import CallShapes, HookPlan, PlannedHook
from hookrun.runtime.vectors import VectorSource

__all__ = ["measure_vectors"]

Measured = dict[tuple[VectorSource, str], torch.Tensor]


def measure_vectors(
    plan: HookPlan,
    shapes: Mapping[str, list[CallShapes]],
    model: nn.Module,
    spec: Any,
    device: torch.device,
) -> Measured:
    """(prompts source, capture path) → the source's float64 mean at that site, for every
    site of every hook whose vector names a prompts file; {} when none does. `spec`: the
    run's RunSpec (its batch size, and its prompts' `prepend_bos`, which the files follow)."""
    wanted: dict[Path, list[tuple[VectorSource, PlannedHook, str]]] = defaultdict(list)
    for hook, site, _ in plan.sites(shapes):
        source = getattr(hook.action, "source", None)
        for measured in source.measured() if source is not None else []:
            wanted[measured.file].append((measured, hook, site))
    if not wanted:
        return {}
    language = adapt(model).language
    if language is None or language.tokenizer is None:
        first = next(iter(wanted.values()))[0][1]
        raise HookrunError(
            f"hooks.{first.name}.args.vector.prompts: the model ({type(model).__name__}) has no "
            "tokenizer to read prompts with; valid: a language model with its tokenizer "
            "(model=hf, model=tiny_lm, LanguageModel(model, tokenizer))"
        )
    out: Measured = {}
    bos = bool(getattr(spec.dataset, "prepend_bos", False))
    reading = _Reading(plan, model, language, (spec.batch_size, bos), device)
    for file, uses in wanted.items():
        sums = reading.sums(file, uses)
        for source, _, site in uses:
            total, count = sums[(site, source.positions)]
            out[(source, site)] = total / count
    return out


def _capture_plan(plan: HookPlan, hooks: list[PlannedHook]) -> HookPlan:
    """Captures at the hooks' sites (each site once), for a plain pass of the model."""
    seen, captures = set(), []
    for hook in hooks:
        rule = (hook.site, hook.layers, hook.functions, hook.within)
        if rule not in seen:
            seen.add(rule)
            action = build_action("capture", {}, f"hooks.{hook.name}")
            captures.append(replace(hook, name=f"{hook.name}.measure", action=action))
    return replace(plan, hooks=captures)


def _rows(file: Path, language: Any, key: str, bos: bool) -> TokenRows:
    """The file's prompts as token rows, as dataset=prompts reads them (a BOS first with
    `bos`); refusals name `key`."""
    limit = language.max_positions()
    most = limit[0] if limit else 1 << 20
    cfg = PromptsDatasetConfig(path=str(file), context=most, prepend_bos=bos)
    try:
        return prompt_rows(prompt_texts(json_rows(file), file), cfg, language.tokenizer)
    except TooLong as err:  # the context is the model's positions here
        raise HookrunError(
            f"{key}: the {err.where} ({err.length} tokens) is longer than the model's {most} "
            f"positions; valid: prompts of at most {most} tokens"
        ) from None
    except HookrunError as err:  # a bad row: named as the vector's file, not the dataset
        raise HookrunError(str(err).replace("dataset.path", key, 1)) from None


@dataclass(frozen=True)
class _Reading:
    """The run's model reading prompts files in batches, with captures at given sites."""

    plan: HookPlan
    model: nn.Module
    language: Any  # its LanguageModel (models/language.py)
    batches: tuple[int, bool]  # rows per pass, and whether each prompt starts with a BOS
    device: torch.device

    def sums(
        self, file: Path, uses: list[tuple[VectorSource, PlannedHook, str]]
    ) -> dict[tuple[str, str], tuple[torch.Tensor, int]]:
        """(site, positions) → (sum of the rows' vectors, how many), in one pass of `file`."""
        capture = _capture_plan(self.plan, [hook for _, hook, _ in uses])
        sites = {site for _, _, site in uses}
        batch_size, bos = self.batches
        rows = _rows(file, self.language, f"{_key(uses, next(iter(sites)))}.prompts", bos)
        sums: dict[tuple[str, str], tuple[torch.Tensor, int]] = {}
        recorder = Recorder(0, torch.float32)
        model, language, device = self.model, self.language, self.device
        with run_mode(model), torch.inference_mode():
            for start in range(0, len(rows), batch_size):
                ids = rows.ids[start : start + batch_size]
                lengths = rows.lengths[start : start + batch_size]
                mask = torch.arange(ids.shape[1])[None] < lengths[:, None]
                recorder.begin(start)
                recorder.rows = torch.arange(start, start + len(ids))
                recorder.mask = mask.to(device)
                with attach(capture, model, recorder):
                    language(input_ids=ids.to(device), attention_mask=mask.to(device).long())
                for event in recorder.events:  # a CUDA copy to the host still under way
                    event.synchronize()
                for site in sites:
                    values = recorder.records[site].double()
                    if values.dim() != 3 or values.shape[1] != ids.shape[1]:
                        raise HookrunError(
                            f"{_key(uses, site)}: /{site} holds {list(values.shape[1:])} per "
                            f"row of {file.name}, not one vector per token; valid: a site of "
                            "(tokens, width) per sample (a block's output)"
                        )
                    _add_rows(sums, site, values, mask)
        return sums


def _add_rows(
    sums: dict[tuple[str, str], tuple[torch.Tensor, int]],
    site: str,
    values: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    """One batch's (N, T, D) `values` at `site` into the sums at each row's last real token
    and at every real token."""
    last = values[torch.arange(len(values)), mask.sum(1) - 1]
    for positions, part in (("last", last), ("all", values[mask])):
        total, count = sums.get((site, positions), (0, 0))
        sums[(site, positions)] = (total + part.sum(0), count + len(part))


def _key(uses: list[tuple[VectorSource, PlannedHook, str]], site: str) -> str:
    hook = next(h for _, h, s in uses if s == site)
    return f"hooks.{hook.name}.args.vector"
