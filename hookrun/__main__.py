"""`python -m hookrun [experiment=NAME] [key=value ...]`: the Hydra entry point."""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hookrun.api import conf_dir
from hookrun.config.groups import refuse_null_groups
from hookrun.config.schema import register_configs
from hookrun.config.shorthands import expanded
from hookrun.errors import HookrunError, Interrupted, one_line
from hookrun.extras import refuse_missing_launcher
from hookrun.quick_exit import QuickExit

register_configs()
log = logging.getLogger("hookrun")


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
def main(cfg: DictConfig) -> None:
    """Run one job. Bad input ends a single run with a one-line message and exit status 2
    (a write fault: 1; SIGTERM/SIGINT: 143/130; an internal error: 1, traceback in the log);
    in a sweep (-m) a failing job is logged and recorded, and the other jobs go on."""
    from hookrun.config.build import build_spec, release_model_keys
    from hookrun.pipeline.claim import MEMORY
    from hookrun.pipeline.runner import execute
    from hookrun.scale.sweeps import write_job_summary

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        release_model_keys(cfg, overrides, caller_model=False)
        spec = build_spec(cfg, hydra_cfg.runtime.choices.get("experiment"))
        if spec.sink.path == MEMORY:
            raise HookrunError(
                "sink.path: memory keeps the file in the Python process that called "
                "hookrun.run, and this command's process ends with the run; valid here: a "
                "file path (the default: <run dir>/captures.h5)"
            )
        result = execute(spec, run_dir)
    except (Exception, Interrupted) as err:  # Interrupted: a BaseException (errors.py)
        if sweeping:
            log.exception("job %s failed", hydra_cfg.job.num)  # the traceback, in its own log
            write_job_summary(run_dir, overrides, "failed", 0, None, _describe(err))
            return
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if isinstance(err, (HookrunError, Interrupted)):
            print(f"hookrun: error: {one_line(err)}", file=sys.stderr)
            sys.exit(err.exit_code)
        where = _write_traceback(err, run_dir)
        first = (str(err).strip().splitlines() or [""])[0]
        print(
            f"hookrun: internal error: {type(err).__name__}: {first} (full traceback in "
            f"{where}; please report it)",
            file=sys.stderr,
        )
        sys.exit(1)
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the batch loop
        print("hookrun: error: interrupted by SIGINT", file=sys.stderr)
        sys.exit(130)
    if sweeping:
        write_job_summary(run_dir, overrides, "complete", result.rows, result.path, "")


def _write_traceback(err: BaseException, run_dir: Path) -> Path:
    """Append the traceback to the run's log file (Hydra's hookrun.log), or to a file of
    its own in the run directory when logging writes no file."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    where = Path(files[0].baseFilename) if files else run_dir / "hookrun-traceback.txt"
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        with open(where, "a") as fh:
            traceback.print_exception(err, file=fh)
    except OSError:
        where = Path(tempfile.mkstemp(prefix="hookrun-traceback-", suffix=".txt")[1])
        where.write_text("".join(traceback.format_exception(err)))
    return where


def _describe(err: Exception | Interrupted) -> str:
    if isinstance(err, (HookrunError, Interrupted)):
        return one_line(err)
    return f"{type(err).__name__}: {err}"


def cli() -> None:
    """The `hookrun` console script and `python -m hookrun`: the same start, the same exits."""
    quick = QuickExit()  # before the run: what start-up loaded is hookrun's own
    sys.argv[1:] = expanded(sys.argv[1:])  # lrp.composite=... is derive.lrp.composite=...
    try:
        refuse_null_groups(sys.argv[1:], conf_dir())  # Hydra's own refusal is a traceback
        refuse_missing_launcher(sys.argv[1:])  # Hydra's own: "Could not find ..." and a list
    except HookrunError as err:
        print(f"hookrun: error: {one_line(err)}", file=sys.stderr)
        sys.exit(err.exit_code)
    try:
        main()
    except SystemExit as end:
        # A signal's stop ends the same way: the file is closed by now, and Slurm's 30 s of
        # grace would otherwise include the teardown (1.5-3.5 s of 4 on two busy cores).
        if end.code in (128 + signal.SIGTERM, 128 + signal.SIGINT):
            quick.leave(end.code)
        raise
    quick.leave()  # a successful run ends here, unless the ordinary exit is needed


if __name__ == "__main__":
    cli()
