"""`python -m hookrun [experiment=NAME] [key=value ...]`: the Hydra entry point."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hookrun.api import conf_dir
from hookrun.errors import HookrunError, one_line
from hookrun.spec.schema import register_configs

register_configs()
log = logging.getLogger("hookrun")


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
def main(cfg: DictConfig) -> None:
    """Run one job. Bad input ends a single run with a one-line message and exit status 2;
    in a sweep (-m) a failing job is logged and recorded, and the other jobs go on."""
    from hookrun.engine.runner import execute
    from hookrun.scale.sweeps import write_job_summary
    from hookrun.spec.build import build_spec

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        spec = build_spec(cfg, hydra_cfg.runtime.choices.get("experiment"))
        result = execute(spec, run_dir)
    except Exception as err:
        if sweeping:
            log.exception("job %s failed", hydra_cfg.job.num)  # the traceback, in its own log
            write_job_summary(run_dir, overrides, "failed", 0, None, _describe(err))
            return
        if isinstance(err, HookrunError) and os.environ.get("HYDRA_FULL_ERROR") != "1":
            print(f"hookrun: error: {one_line(err)}", file=sys.stderr)
            sys.exit(2)
        raise
    if sweeping:
        write_job_summary(run_dir, overrides, "complete", result.rows, result.path, "")


def _describe(err: Exception) -> str:
    if isinstance(err, HookrunError):
        return one_line(err)
    return f"{type(err).__name__}: {err}"


if __name__ == "__main__":
    main()
