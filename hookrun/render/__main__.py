"""`python -m hookrun.render captures.h5 [--out DIR] [--max N]`: re-draw an earlier run."""

from __future__ import annotations

import argparse
from pathlib import Path

from hookrun.errors import first_line
from hookrun.render.draw import render

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m hookrun.render` (the CLI reference prints its help).

    Returns:
        The parser of a captures.h5 path, --out and --max.
    """
    cli = argparse.ArgumentParser(
        prog="python -m hookrun.render", description="Re-draw the pictures of an earlier run."
    )
    cli.add_argument("path", help="a captures.h5 written by hookrun")
    cli.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the pictures (default: <run dir>/images/<experiment>)",
    )
    cli.add_argument("--max", type=int, default=16, help="samples to draw (first rows)")
    return cli


def main(argv: list[str] | None = None) -> None:
    """`python -m hookrun.render captures.h5`: re-draw the pictures of an earlier run.

    Args:
        argv: The command line's arguments; None reads sys.argv.
    """
    cli = parser()
    args = cli.parse_args(argv)
    if not args.path or not Path(args.path).is_file():
        what = "not a file" if args.path and Path(args.path).exists() else "no such file"
        cli.error(f"{args.path!r}: {what}")
    args.path = Path(args.path)
    try:
        written = render(args.path, args.out, args.max)
    except (OSError, KeyError, RuntimeError, ValueError) as err:
        # Not HDF5, cut short, damaged metadata, not a file hookrun wrote: one line.
        cli.exit(1, f"python -m hookrun.render: error: {args.path}: {first_line(err)}\n")
    if not written:
        print(f"nothing to draw in {args.path}")
        return
    print(f"{len(written)} pictures in {written[-1].parent}")


if __name__ == "__main__":
    main()
