"""`python -m hookrun [experiment=NAME] [key=value ...]`: the Hydra entry point."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hookrun.config import register_configs
from hookrun.errors import HookrunError, one_line

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Run one job; bad input ends it with a one-line message and exit status 2."""
    from hookrun.runner import run  # heavy imports (torch) only once Hydra has parsed the CLI

    try:
        hydra_cfg = HydraConfig.get()
        experiment = hydra_cfg.runtime.choices.get("experiment")
        run(cfg, Path(hydra_cfg.runtime.output_dir), experiment)
    except HookrunError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"hookrun: error: {one_line(err)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
