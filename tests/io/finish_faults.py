"""`python finish_faults.py FAULT [key=value ...]`: `python -m hookrun [key=value ...]` with a
fault injected inside the stages' whole-run work (their `finish`), for tests/io/test_whole_run.py:

- kill-before: SIGKILL as a stage's finish starts (nothing computed);
- kill-computed: SIGKILL once its values are computed, before any is written;
- kill-marking: SIGKILL once its values are written and flushed, before they are marked;
- term: SIGTERM to itself as a stage's finish starts (which then goes on computing);
- fill-disk: as a stage's finish starts, the file's disk filled up (a file `filler` beside
  it, written until the disk refuses: ENOSPC), so the whole-run values find no room;
- kill-joining: SIGKILL while rank 0 joins the torchrun shards, the join half made;
- kill-complete: SIGKILL as a stage writes what it says of all the rows (`Stage.complete`:
  the sanity verdicts), before the file is marked complete;
- totals / totals-kill-second: two stages of this file's own (below) with whole-run work,
  each appending its name to the file FINISH_LOG names when its finish runs; the second
  SIGKILLs the process the first time it runs (no FINISH_LOG + ".killed" yet).

A real process, killed or signalled where the fault says, as a preempted job is.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import h5py
import numpy as np

import hookrun.stages  # noqa: F401  (registers every stage, so their plans can be wrapped)
from hookrun.io import stored, whole_run
from hookrun.io.encoding import read_floats
from hookrun.stage import Plan, Setup, Stage, WholeRun, register_stage


def _killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _fill(path: Path) -> None:
    """Write `path` until its disk has no room left."""
    block = b"\0" * (64 << 10)
    with path.open("wb") as out:
        try:
            while True:
                out.write(block)
                out.flush()
        except OSError:
            pass


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def _inject(fault: str) -> None:
    for cls in _subclasses(Plan):
        if "finish" not in vars(cls):
            continue

        real_finish = vars(cls)["finish"]

        def finish(self, f, real=real_finish):  # noqa: ANN001
            if fault == "kill-before":
                _killed()
            if fault == "term":
                os.kill(os.getpid(), signal.SIGTERM)
            if fault == "fill-disk":
                _fill(Path(f.filename).with_name("filler"))
            values = real(self, f)
            if fault == "kill-computed":
                _killed()
            return values

        cls.finish = finish
    if fault == "kill-complete":
        for cls in _subclasses(Stage):
            if "complete" in vars(cls):
                cls.complete = classmethod(lambda cls_, f, rows, shards: _killed())
    if fault == "kill-marking":
        whole_run.mark_written = lambda ds: _killed()
    if fault == "kill-joining":
        real_write = stored.write_header

        def write_header(f, header):  # noqa: ANN001
            real_write(f, header)
            f.flush()  # the half-made join on disk, as far as it goes
            _killed()

        stored.write_header = write_header


class _TotalPlan(Plan):
    """/<name>/total (1,): the sum of every row's /model/output, once every row is in."""

    def __init__(self, name: str, rows: int, kill: bool) -> None:
        self.name, self.rows, self.kill = name, rows, kill

    def finishes(self) -> dict[str, WholeRun]:
        return {f"{self.name}/total": WholeRun((1,))}

    def finish(self, f: h5py.File) -> dict[str, np.ndarray]:
        log = Path(os.environ["FINISH_LOG"])
        with log.open("a") as out:
            out.write(self.name + "\n")
        killed = log.with_name(log.name + ".killed")
        if self.kill and not killed.exists():
            killed.touch()
            _killed()
        output = read_floats(f["model/output"], slice(0, self.rows)).astype(np.float64)
        return {f"{self.name}/total": np.array([output.sum()])}


def _register_totals(kill_second: bool) -> None:
    for order, name in ((90, "first"), (91, "second")):

        class Totals(Stage):
            @classmethod
            def plan(cls, config, setup: Setup, name=name) -> Plan:  # noqa: ANN001
                return _TotalPlan(name, len(setup.data), kill_second and name == "second")

        Totals.name, Totals.order, Totals.axes = name, order, {f"{name}/total": "value"}
        register_stage(Totals)


if __name__ == "__main__":
    fault = sys.argv[1]
    if fault.startswith("totals"):
        _register_totals(fault == "totals-kill-second")
    _inject(fault)
    sys.argv = ["hookrun", *sys.argv[2:]]
    from hookrun.__main__ import main

    main()
