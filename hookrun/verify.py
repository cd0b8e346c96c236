"""`python -m hookrun.verify FILE`: is this captures.h5 complete and intact?

Reads every chunk of every dataset (HDF5 checks each chunk's fletcher32 checksum as it reads
it), checks that every dataset holds the rows `completed` promises (a sparse record the
entries its counts promise, each latent index inside its width), that every stage's
whole-run results are written (a file killed during that work holds them pending), that every
axis has its dimension name (the `sample` coordinate holding the dataset indices), and that
the file is not cut short. Prints the status, the rows and any damage; exit status 0 only for
a complete, intact file, 1 otherwise (2 for a path that is not a file).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import h5py

from hookrun.errors import first_line
from hookrun.io.dimensions import check_dimensions
from hookrun.io.layout import (
    JOB_ATTR,
    MODEL_OUTPUT,
    SAMPLES_INDEX,
    SPARSE_COUNTS,
    attr,
    dataset_names,
    open_readonly,
    pending,
    read_state,
    rows_for,
    sparse_groups,
    sparse_part,
)
from hookrun.io.sparse_record import sparse_damage
from hookrun.io.storage import cut_short, missing_rows, unreadable_rows
from hookrun.stage import stages

__all__ = ["verify", "main"]

# What every captures.h5 hookrun writes holds: without them a file is not one, whatever
# its `status` attribute says.
_REQUIRED = (SAMPLES_INDEX, MODEL_OUTPUT)


def _damage(f: h5py.File, path: Path) -> tuple[str, int, list[str], list[str]]:
    """(status, completed rows, datasets, damage) of an open captures file."""
    state = read_state(f)
    names = dataset_names(f)
    damage: list[str] = []
    if state.config is None:
        damage.append("no config attribute: not a file hookrun wrote")
    # A stage's job of its own (a training job: layout attribute `job`) writes no rows.
    required = () if attr(f, JOB_ATTR) else _REQUIRED
    damage += [
        f"/{name}: missing (every hookrun file has it)" for name in required if name not in names
    ]
    for stage in stages():  # what a stage says of its part (a sanity check's verdicts)
        damage += stage.damage(f, state.status == "complete")
    waiting = pending(f)
    for name in waiting:  # a whole-run result its stage has not written (a kill, a signal)
        stage = name.split("/")[0]
        damage.append(
            f"{name}: not written: the {stage} stage's whole-run work is not in the file "
            "(resume=true computes it)"
        )
    for name in names:
        ds = f[name]
        if name in waiting:
            continue  # holds no values: what it holds is not damage
        rows = ds.shape[0] if ds.shape else 0
        # A record stored once per batch holds a row per batch of the completed samples.
        need = rows_for(ds, state.completed)
        cut = missing_rows([ds], need, path.stat().st_size)
        if cut:
            damage.append(cut)
        # A sparse record's entries short of its counts: one line for the record (below).
        entries = sparse_part(ds) not in (None, SPARSE_COUNTS)
        if rows < need and not entries:
            damage.append(
                f"{name}: {rows} rows, fewer than the {need} completed={state.completed} needs"
            )
        if entries and state.status != "complete":
            # A killed writer's last chunk of entries may be torn past what `completed`
            # counts, which resume reads past its checksum (storage.torn_tail_rows).
            unreadable = unreadable_rows(ds, min(rows, need), torn_tail=True)
        else:
            unreadable = unreadable_rows(ds, rows)
        if unreadable:
            damage.append(unreadable)
    for group in sparse_groups(f):  # entries the counts promise, indices inside the width
        damage += sparse_damage(f[group], state.completed)
    damage += check_dimensions(f, state.completed)  # names as xarray and netCDF read them
    return state.status or "none", state.completed, names, damage


def verify(path: Path) -> tuple[bool, list[str]]:
    """(complete and intact, lines to print) for the captures file at `path`."""
    reason = cut_short(path)
    if reason:
        return False, [f"{path}: damaged: {reason}"]
    try:
        f = open_readonly(path)
    except OSError as err:
        return False, [f"{path}: cannot be opened: {str(err).splitlines()[0]}"]
    with f:
        try:
            status, completed, names, damage = _damage(f, path)
            error = read_state(f).error
        except (OSError, RuntimeError, ValueError, KeyError) as err:  # damaged metadata
            return False, [f"{path}: damaged: its metadata cannot be read ({first_line(err)})"]
    lines = [f"{path}: status {status}, {completed} rows complete, {len(names)} datasets read"]
    if error:
        lines.append(f"  recorded error: {error}")
    lines += [f"  damaged: {d}" for d in damage]
    intact = not damage
    lines.append("  intact" if intact else f"  {len(damage)} damaged dataset(s)")
    return status == "complete" and intact, lines


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m hookrun.verify` (the CLI reference prints its help).

    Returns:
        The parser of one FILE argument.
    """
    cli = argparse.ArgumentParser(
        prog="python -m hookrun.verify",
        description="Is this captures.h5 complete and intact? Exit status 0 only for a "
        "complete, intact file, 1 otherwise, 2 for a path that is not a file.",
    )
    cli.add_argument("file", help="a captures.h5 written by hookrun")
    return cli


def main(argv: list[str] | None = None) -> int:
    """Verify one file and print its status, rows and any damage.

    Args:
        argv: The command line's arguments; None reads sys.argv.

    Returns:
        The exit status: 0 for a complete, intact file, 1 otherwise, 2 for a bad path.
    """
    cli = parser()
    try:
        args = cli.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as stop:  # argparse's usage error: exit status 2, as before
        return int(stop.code or 0)
    path = Path(args.file)
    if not args.file or not path.is_file():
        what = "not a file" if args.file and path.exists() else "no such file"
        print(f"hookrun.verify: error: {args.file!r}: {what}", file=sys.stderr)
        return 2
    ok, lines = verify(path)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
