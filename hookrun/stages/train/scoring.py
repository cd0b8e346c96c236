"""A trained dictionary scored on the held-out rows: a run of the scores stage (sae_scores)
with the saved folder spliced in at its site, error term on, into a file of its own."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import OmegaConf

from hookrun.config.build import build_spec
from hookrun.config.schema import run_schema
from hookrun.io.layout import attr, capture_key, open_readonly
from hookrun.stage import JobContext
from hookrun.stages.sae.keys import FIELDS_ATTR, scores_key
from hookrun.training.config import Dictionary

__all__ = ["scorer"]

log = logging.getLogger("hookrun")


def _splice(d: Dictionary, folder: Path) -> dict[str, Any] | None:
    """The hook that splices the saved dictionary where it was trained; None for a
    transcoder that reads another module than the one it writes (the transcoder action
    reads its module's own input)."""
    module, site = d.site.target
    if d.site.transcoder and d.site.source != (module, "input"):
        return None
    return {
        "select": {"name": module},
        "at": site,
        "action": "transcoder" if d.site.transcoder else "sae",
        "args": {"path": str(folder), "error_term": True, "record": ["latents"]},
    }


def scorer(spec: Any, ctx: JobContext, rows: int):
    """score(folder, dictionary, run_dir, model, weights_file): its scores on the dataset's
    first `rows` rows, by a run given the job's model (not built again: no second copy of
    a large model at the end of its training)."""
    base = yaml.safe_load(spec.config_yaml)

    def score(
        folder: Path, d: Dictionary, run_dir: Path, model: Any, weights_file: Path | None
    ) -> dict | None:
        hook = _splice(d, folder)
        if hook is None:
            log.warning("%s: a transcoder from %s is not scored", d.name, d.site.label)
            return None
        config = dict(base)
        config.update(
            hooks={"sae": hook},
            sae={},
            sae_scores={"ce": None, "dense": 0.1, "special": "exclude"},
            limit=rows,
            resume=run_dir.joinpath("captures.h5").exists(),
            dry_run=False,
            render=False,
            progress=False,
            logger=None,
            sink={**base.get("sink", {}), "path": None, "overwrite": False},
        )
        composed = OmegaConf.merge(OmegaConf.structured(run_schema()), config)
        other = build_spec(composed, "sae")
        result = ctx.execute(other, run_dir, model, weights_file)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return None  # a torchrun rank's shard: rank 0 joins them and reads the scores
        module, site = d.site.target
        key = scores_key(capture_key(module, site))
        with open_readonly(result.path) as f:
            ds = f[key]
            return {
                "fields": [str(x) for x in attr(ds, FIELDS_ATTR)],
                "values": [float(v) for v in ds[()]],
                "file": str(result.path),
            }

    return score
