"""`python -m hookrun.verify FILE`: is this captures.h5 complete and intact?

Reads every chunk of every dataset (HDF5 checks each chunk's fletcher32 checksum as it reads
it), checks that every dataset holds the rows `completed` promises, and that the file is not
cut short. Prints the status, the rows and any damage; exit status 0 only for a complete,
intact file, 1 otherwise (2 for a path that is not a file).
"""

from __future__ import annotations

import sys
from pathlib import Path

import h5py

from hookrun.io.layout import dataset_names, open_readonly, read_state, rows_for
from hookrun.io.storage import cut_short, missing_rows

__all__ = ["verify", "main"]

# Rows read at a time from a dataset without chunks (a virtual dataset over torchrun shards).
_SLAB = 256


def _read_all(ds: h5py.Dataset) -> None:
    """Read every stored byte of `ds`; OSError (a checksum, a missing shard) on damage."""
    if ds.chunks is not None:
        for chunk in ds.iter_chunks():
            ds[chunk]
        return
    for start in range(0, ds.shape[0] if ds.shape else 1, _SLAB):
        ds[start : start + _SLAB] if ds.shape else ds[()]


def verify(path: Path) -> tuple[bool, list[str]]:
    """(complete and intact, lines to print) for the captures file at `path`."""
    reason = cut_short(path)
    if reason:
        return False, [f"{path}: damaged: {reason}"]
    try:
        f = open_readonly(path)
    except OSError as err:
        return False, [f"{path}: cannot be opened: {str(err).splitlines()[0]}"]
    damage: list[str] = []
    with f:
        state = read_state(f)
        names = dataset_names(f)
        for name in names:
            ds = f[name]
            rows = ds.shape[0] if ds.shape else 0
            # A record stored once per batch holds a row per batch of the completed samples.
            need = rows_for(ds, state.completed)
            cut = missing_rows([ds], need, path.stat().st_size)
            if cut:
                damage.append(cut)
            if rows < need:
                damage.append(
                    f"{name}: {rows} rows, fewer than the {need} completed={state.completed} needs"
                )
            try:
                _read_all(ds)
            except (OSError, RuntimeError, ValueError) as err:
                damage.append(f"{name}: unreadable: {str(err).splitlines()[0]}")
    lines = [
        f"{path}: status {state.status or 'none'}, {state.completed} rows complete, "
        f"{len(names)} datasets read"
    ]
    if state.error:
        lines.append(f"  recorded error: {state.error}")
    lines += [f"  damaged: {d}" for d in damage]
    intact = not damage
    lines.append("  intact" if intact else f"  {len(damage)} damaged dataset(s)")
    return state.status == "complete" and intact, lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hookrun.verify FILE", file=sys.stderr)
        return 2
    path = Path(args[0])
    if not path.is_file():
        print(f"hookrun.verify: error: {path} is not a file", file=sys.stderr)
        return 2
    ok, lines = verify(path)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
