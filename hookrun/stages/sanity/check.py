"""The sanity check by model randomisation (Adebayo et al. 2018), batch by batch.

For each batch, each method in `sanity.methods` runs its experiment's hooks and derived
results (config/experiments.py) on the original model and after each randomisation step
(stages/sanity/randomize.py), always explaining the original model's prediction (the run's
/samples/target); each map is compared with the original's (stages/sanity/similarity.py).
Stored: /sanity/<method>/<similarity> (N, steps + 1; column 0 is the original, 1.0), the
maps at /sanity/<method>/maps with `sanity.keep_maps`, the /sanity group's `layers` and
`threshold`; the verdicts (`passed`, `score`) are written from the stored rows before the
file is complete (io/walk.write_verdicts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hookrun.io import layout
from hookrun.runtime.hooks import run_mode
from hookrun.runtime.plan import HookPlan, check_reached, compile_plan
from hookrun.runtime.shape_probe import probe_shapes
from hookrun.stage import Stored
from hookrun.stages.derive.registry import Derivation, plan_derivations
from hookrun.stages.evaluate.relevance import check_attribution
from hookrun.stages.sanity.config import SIMILARITIES, SanityMethod, SanitySpec
from hookrun.stages.sanity.keys import sanity_attrs, sanity_key
from hookrun.stages.sanity.randomize import Randomizer, check_layers, default_layers
from hookrun.stages.sanity.similarity import similarities, to_map

__all__ = ["PreparedMethod", "SanityCheck", "prepare_sanity"]

log = logging.getLogger("hookrun")


@dataclass(frozen=True)
class PreparedMethod:
    """One checked method, compiled against the model: its hooks' plan, derived results,
    and the record that holds its map."""

    name: str
    plan: HookPlan
    derivations: list[Derivation]
    folds: Mapping[str, int]
    key: str  # the record (captures.h5 path) of its map
    shape: tuple[int, ...]  # the map's per-sample shape as compared: (h, w)


def _prepare_method(method: SanityMethod, model: nn.Module, sample: torch.Tensor) -> PreparedMethod:
    plan = compile_plan(method.hooks, model)
    shapes, _, plan = probe_shapes(model, plan, sample)
    plan, _ = check_reached(plan, shapes)
    captures = plan.capture_shapes(shapes)
    with run_mode(model):
        derivations = plan_derivations(method.derive, set(captures), model, sample)
    key, shape = layout.INPUT_GRAD, captures.get(layout.INPUT_GRAD)
    for d in derivations:
        if d.method.name == method.derived:
            key, shape = d.key, d.stored_shapes(tuple(sample.shape))[d.key]
    if shape is None:  # an experiment file changed under the choices
        raise RuntimeError(f"sanity: {method.name} makes no map")
    check_attribution(f"sanity.methods: {method.name} ({key})", shape, tuple(sample.shape))
    return PreparedMethod(method.name, plan, derivations, plan.folds(shapes), key, shape[-2:])


class SanityCheck:
    """The prepared check: methods, the layers randomised, and how each batch runs."""

    def __init__(
        self,
        spec: SanitySpec,
        methods: list[PreparedMethod],
        randomizer: Randomizer,
        store_dtype: torch.dtype,
    ) -> None:
        self.config, self.methods, self.randomizer = spec.config, methods, randomizer
        self.layers = randomizer.layers
        self.store_dtype = store_dtype

    def stored(self) -> dict[str, Stored]:
        """Every dataset written, by path: per-sample shape (and no attributes)."""
        columns = len(self.layers) + 1
        out = {}
        for m in self.methods:
            for name in SIMILARITIES:
                out[sanity_key(m.name, name)] = Stored((columns,), {})
            if self.config.keep_maps:
                out[sanity_key(m.name, "maps")] = Stored((columns, *m.shape), {})
        return out

    def attrs(self) -> dict[str, dict]:
        """The /sanity group's attributes."""
        return sanity_attrs(list(self.layers), self.config.threshold)

    def batch(
        self,
        batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        run_method: Callable[[PreparedMethod, tuple], Mapping[str, torch.Tensor]],
    ) -> dict[str, torch.Tensor]:
        """The sanity datasets' rows for one batch: `batch` = (inputs, the original model's
        targets, dataset indices); `run_method(method, batch)` gives one method's records
        on the model as it is now."""
        maps: dict[str, list[torch.Tensor]] = {m.name: [] for m in self.methods}
        with self.randomizer.steps():  # the original weights are back on any exit
            for step in range(len(self.layers) + 1):
                if step:
                    self.randomizer.apply(step - 1)
                for m in self.methods:
                    record = torch.as_tensor(run_method(m, batch)[m.key])
                    stored = record.to(self.store_dtype).float()  # as the file holds it
                    maps[m.name].append(to_map(stored, self.config.reduce))
        out: dict[str, torch.Tensor] = {}
        for m in self.methods:
            stack = torch.stack(maps[m.name], dim=1)  # (N, steps + 1, h, w)
            columns = {name: [np.ones(len(stack))] for name in SIMILARITIES}
            for step in range(1, stack.shape[1]):
                for name, values in similarities(stack[:, step], stack[:, 0]).items():
                    columns[name].append(values)
            for name, values in columns.items():
                out[sanity_key(m.name, name)] = torch.from_numpy(np.stack(values, 1)).float()
            if self.config.keep_maps:
                out[sanity_key(m.name, "maps")] = stack
        return out


def prepare_sanity(
    spec: SanitySpec | None, model: nn.Module, sample: torch.Tensor, seed: int, dtype: torch.dtype
) -> SanityCheck | None:
    """The SanityCheck of a run (None without `sanity:`): layers found or checked, each
    method compiled and probed, the randomised weights drawn (the model is given back)."""
    if spec is None:
        return None
    with run_mode(model):
        layers = (
            default_layers(model, sample)
            if spec.config.layers == "auto"
            else list(spec.config.layers)
        )
    check_layers(model, layers)
    methods = [_prepare_method(m, model, sample) for m in spec.methods]
    randomizer = Randomizer(model, layers, seed, spec.config.mode == "cascading")
    log.info("sanity: randomising (%s) %s", spec.config.mode, ", ".join(layers))
    return SanityCheck(spec, methods, randomizer, dtype)
