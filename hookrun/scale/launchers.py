"""Slurm through submitit, with preempted or timed-out jobs requeued as `resume=true`."""

from __future__ import annotations

from typing import Any

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

__all__ = ["ResumingSlurmLauncher", "with_resume"]


def with_resume(overrides: list[str]) -> list[str]:
    """The job's overrides with resume=true (replacing any resume=... already there)."""
    kept = [o for o in overrides if not o.lstrip("+").startswith("resume=")]
    return [*kept, "resume=true"]


class ResumingSlurmLauncher(SlurmLauncher):
    """submitit calls `checkpoint` when Slurm preempts or times out a job; the job is
    resubmitted with the same arguments plus resume=true, so it continues its own
    captures.h5 from `completed` instead of starting over (or refusing an existing file)."""

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        sweep_overrides, *rest = args
        return super().checkpoint(with_resume(list(sweep_overrides)), *rest, **kwargs)
