"""The experiments as attribution methods: the sanity check runs the hooks and derived
results of `conf/experiment/<name>.yaml` for each method it checks, so a method's maps are
exactly what `python -m hookrun experiment=<name>` computes (one owner: the experiment file).

An experiment makes one attribution when it derives something (its last derived result is
the attribution) or, deriving nothing, captures the input gradient.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hookrun.config.schema import conf_dir

__all__ = ["attribution_experiments", "derived_by", "method_nodes"]


@cache
def _raw(name: str) -> dict[str, Any]:
    node = OmegaConf.load(conf_dir() / "experiment" / f"{name}.yaml")
    return OmegaConf.to_container(node, resolve=False)  # type: ignore[return-value]


def _makes_attribution(raw: dict[str, Any]) -> bool:
    if raw.get("derive"):
        return True
    return any(
        (h or {}).get("select", {}).get("name") == "input" and (h or {}).get("at") == "grad_output"
        for h in (raw.get("hooks") or {}).values()
        if (h or {}).get("action") == "capture"
    )


def attribution_experiments() -> list[str]:
    """Every experiment that makes one attribution (the valid `sanity.methods`), sorted."""
    names = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))
    return [n for n in names if _makes_attribution(_raw(n))]


def derived_by(name: str) -> list[str]:
    """The derived methods experiment `name` runs (its `derive:` keys)."""
    return list(_raw(name).get("derive") or {})


def method_nodes(name: str, cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hooks, derive) of experiment `name`, resolved against the run's `model` (so
    `${model.cam_layer}` is the run's CAM layer)."""
    raw = _raw(name)
    tree = OmegaConf.create(
        {
            "model": OmegaConf.to_container(cfg.model, resolve=True),
            "hooks": raw.get("hooks") or {},
            "derive": raw.get("derive") or {},
        }
    )
    resolved = OmegaConf.to_container(tree, resolve=True)
    return resolved["hooks"], resolved["derive"]  # type: ignore[index]
