"""The steering stage (`steering:`, experiment=steering): the run's hook adds a vector —
measured from two prompt sets at each layer (pipeline/measure.py) — while the metrics
stage scores the rows with and without it (the effect: `steering.effect`'s change) and the
generate stage writes text under it (fluency: its log probability under the plain model).

This stage stores each vector the hooks used at /steering/vector/<site> with where it came
from (keys.py), prints them in the summary, and ranks a sweep's jobs (ranking.py): the
layer × scale multirun ends in steering_ranking.csv/.md and a picture of effect against
fluency."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from omegaconf import OmegaConf

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.runtime.plan import PlannedHook
from hookrun.stage import ParseContext, Plan, Setup, Stage, WholeRun, register_stage
from hookrun.stages.steering.config import SteeringConfig, parse_steering
from hookrun.stages.steering.keys import STEERING, VECTORS, site_of, vector_key
from hookrun.stages.steering.ranking import write_steering_ranking

__all__ = ["SteeringStage"]

layout.whole_run(f"{VECTORS}/*")  # one vector per site for the run: no sample axis


class SteeringPlan(Plan):
    def __init__(self, config: SteeringConfig, hooks: list[PlannedHook]) -> None:
        self.config, self.hooks = config, hooks

    def describe(self, itemsize: int) -> str:
        sites = [site for hook in self.hooks for site in hook.action.vectors]
        return f"/{VECTORS}: {len(sites)} vector(s), written once every row is in"

    def _vectors(self) -> dict[str, tuple[Any, dict[str, Any]]]:
        """Each vector the hooks add, by path: (the vector, what it came from)."""
        out: dict[str, tuple[Any, dict[str, Any]]] = {}
        for hook in self.hooks:
            action = hook.action
            said = {"hook": hook.name, "action": action.name, "source": _json(action)}
            said |= {
                k: getattr(action.args, k)
                for k in ("scale", "normalize")
                if hasattr(action.args, k)
            }
            said |= action.sources()
            for site, vector in action.vectors.items():
                out[vector_key(site)] = (vector, said)
        return out

    def attrs(self) -> dict[str, dict[str, Any]]:
        return {STEERING: self._said()}

    def finishes(self) -> dict[str, WholeRun]:
        """The vectors and what they came from (measured before any work, written with the
        run's other whole-run results)."""
        return {
            key: WholeRun(tuple(vector.shape), str(vector.numpy().dtype), said)
            for key, (vector, said) in self._vectors().items()
        }

    def finish(self, f: h5py.File) -> dict[str, np.ndarray]:
        return {key: vector.numpy() for key, (vector, _) in self._vectors().items()}

    def _said(self) -> dict[str, Any]:
        """The run's steering as its hooks did it (an override of hooks.steer included):
        the effect metric, the first vector hook's scale and the modules steered."""
        first = self.hooks[0].action.args
        modules = [
            site_of(vector_key(s)).rsplit("/", 1)[0] for h in self.hooks for s in h.action.vectors
        ]
        scale = float(getattr(first, "scale", 1.0))
        return {
            "effect": self.config.effect,
            "scale": scale,
            "layers": list(dict.fromkeys(modules)),
        }


def _json(action: Any) -> str:
    given = action.args.vector
    return json.dumps(OmegaConf.to_container(OmegaConf.create({"v": given}))["v"], default=str)


@register_stage
class SteeringStage(Stage):
    name = node = "steering"
    order = 65
    axes = {f"{VECTORS}/*": "feature"}

    @classmethod
    def schema(cls) -> Mapping[str, type]:
        return {"steering": SteeringConfig}

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> Any:
        return parse_steering(raw)

    @classmethod
    def plan(cls, config: SteeringConfig, setup: Setup) -> Plan:
        setup.causal_language("steering")
        hooks = [h for h in setup.plan.hooks if getattr(h.action, "vectors", None)]
        seen: dict[str, str] = {}
        for hook in hooks:
            for site in hook.action.vectors:
                if site in seen:
                    raise HookrunError(
                        f"hooks.{hook.name}: a second vector at /{site} (hooks.{seen[site]} adds "
                        f"one there); valid: one vector hook per site under steering (one "
                        f"vector, e.g. their sum in a file)"
                    )
                seen[site] = hook.name
        if not hooks:
            raise HookrunError(
                "steering: no hook adds or removes a vector; valid: a hook with action add or "
                "ablate_direction and args.vector (experiment=steering's hooks.steer)"
            )
        # The metrics stage computes the effect's metric whatever metrics.names lists; off
        # (metrics: null), nothing measures the effect.
        if setup.spec.stage("metrics") is None:
            raise HookrunError(
                f"steering.effect: {config.effect}, but the run computes no metrics (metrics "
                "is off); valid: metrics=lm (experiment=steering's default)"
            )
        return SteeringPlan(config, hooks)

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        if VECTORS not in f:
            return []
        lines: list[str] = []

        def line(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset) and not layout.is_dimension(obj):
                norm = float(np.linalg.norm(obj[()]))
                scale = layout.attr(obj, "scale")
                times = f" x {float(scale):g}" if scale is not None else ""
                lines.append(
                    f"steering vector at {site_of(obj.name.lstrip('/'))}: norm {norm:.4g}{times} "
                    f"({layout.attr(obj, 'action')}, /{obj.name.lstrip('/')})"
                )

        f[VECTORS].visititems(line)
        return lines

    @classmethod
    def rank(cls, sweep_dir: Path, jobs: list[dict[str, Any]]) -> list[Path]:
        return write_steering_ranking(sweep_dir, jobs)
